//===- tests/cli/frag_run_pt2_test.cpp - `frag run` on .pt2 archives (NativeRT) ===//
//
// The reference models exported twice from the same weights (rank{r}.pt and
// rank{r}.pt2): `frag run` of the .pt2 rank files, plain exports rewritten in
// memory and run by NativeRT, must give what the TorchScript files give with
// the same plan — saves at every fragmented location and at whole ones,
// edits (set/add/scale/zero with slices across q|k and gate|up) — within
// 1e-5 relative; a read-only plan leaves the logits bit-identical to none.
// A plan step that calls modules ad hoc is refused in words (one line, no
// output file): NativeRT runs the archive's whole graph only.
//
//===----------------------------------------------------------------------===//
#include "runtime/safetensors.h"
#include "tests/support/test_support.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>

namespace frag {
namespace {

using testing::frag;
using testing::frag_binary;
using testing::lines_of;
using testing::model_files;
using testing::run_command;
using testing::temporary_folder;
using testing::write_text;

constexpr double kTolerance = 1e-5;

std::vector<std::string> pt2_files(const std::string& export_name) { return model_files(export_name, "pt2"); }

std::string ids_file(const std::string& folder) {
  std::string path = folder + "/ids.txt";
  write_text(path, "1 2 3 4 5 6 7 8\n999 17 42 63 64 65 500 0\n");
  return path;
}

/// Runs `plan` (JSON text; none if empty) and returns what --out holds; `output` gets the run's output.
std::map<std::string, torch::Tensor> run_plan(const std::vector<std::string>& files, const std::string& folder,
                                              const std::string& name, const std::string& plan,
                                              testing::CommandResult* result_out = nullptr) {
  const std::string plan_file = folder + "/" + name + ".json", out = folder + "/" + name + ".safetensors";
  std::vector<std::string> argv{frag_binary(), "run", "--world", std::to_string(files.size())};
  argv.insert(argv.end(), files.begin(), files.end());
  argv.insert(argv.end(), {"--input", ids_file(folder), "--out", out, "--timeout", "60"});
  if (!plan.empty()) {
    write_text(plan_file, plan);
    argv.insert(argv.end(), {"--plan", plan_file});
  }
  auto result = run_command(argv);
  if (result_out) {
    *result_out = result;
    return {};
  }
  EXPECT_EQ(result.exit_code, 0) << result.output;
  return result.exit_code == 0 ? runtime::read_safetensors(out) : std::map<std::string, torch::Tensor>{};
}

double relative(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

void expect_close(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, value] : want) {
    ASSERT_EQ(got.count(name), 1u) << what << ": " << name;
    ASSERT_EQ(got.at(name).sizes(), value.sizes()) << what << ": " << name;
    EXPECT_LE(relative(got.at(name), value), kTolerance) << what << ": " << name;
  }
}

struct Case {
  const char* pt2;
  const char* torchscript;
  const char* gate_up;  ///< a MergedColumnParallelLinear's output (gate|up)
};

class RunPt2 : public ::testing::TestWithParam<Case> {};

TEST_P(RunPt2, SavesAtEveryLocationAndEditsAsTheTorchScriptExport) {
  FRAG_REQUIRE_GLOO();
  FRAG_REQUIRE_NATIVERT();
  auto folder = temporary_folder();
  const auto files = pt2_files(GetParam().pt2);
  const auto ts_files = model_files(GetParam().torchscript);
  std::vector<std::string> inspect_args{"inspect", "--json"};
  inspect_args.insert(inspect_args.end(), files.begin(), files.end());
  auto inspect = frag(inspect_args);
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  const auto table = nlohmann::json::parse(inspect.out);
  // Read-only: a save at every fragmented location and at a few whole ones.
  std::string saves;
  int count = 0;
  std::map<std::string, std::string> save_of;
  for (const auto& row : table.at("fragmented")) {
    const std::string location = row.at("location");
    save_of[location] = fmt::format("s{}", count);
    saves += (saves.empty() ? "" : ",\n") + fmt::format(R"({{"at": "{}", "do": "save", "as": "s{}"}})", location, count++);
  }
  ASSERT_GT(count, 8);
  for (const char* whole : {"model.layers.0.output", "model.layers.1.input", "model.norm.output"})
    saves += fmt::format(",\n{{\"at\": \"{}\", \"do\": \"save\", \"as\": \"{}\"}}", whole, whole);
  const std::string read_only = "{\"interventions\": [" + saves + "]}";
  auto plain = run_plan(files, folder, "plain", "");
  auto exported = run_plan(files, folder, "read_only", read_only);
  auto scripted = run_plan(ts_files, folder, "read_only_ts", read_only);
  ASSERT_EQ(exported.size(), static_cast<size_t>(count) + 4);  // + the logits
  expect_close(exported, scripted, "read-only plan, .pt2 vs TorchScript");
  ASSERT_EQ(plain.count("logits"), 1u);
  EXPECT_TRUE(torch::equal(exported.at("logits"), plain.at("logits")));
  // Edits: add (a value file) at a whole location, zero across q|k, set across gate|up, scale a shard.
  const auto hidden = exported.at("model.layers.0.output").size(-1);
  ASSERT_EQ(save_of.count(GetParam().gate_up), 1u);
  const auto half = exported.at(save_of.at(GetParam().gate_up)).size(-1) / 2;
  runtime::write_safetensors(folder + "/values.safetensors",
                             {{"v", torch::linspace(-1, 1, hidden)}, {"quarter", torch::full({1}, 0.25)}});
  const std::string edits = fmt::format(R"({{"interventions": [
    {{"at": "model.layers.0.output", "do": "add", "value": "{0}/values.safetensors:v"}},
    {{"at": "model.layers.0.self_attn.qkv_proj.output", "do": "zero", "index": "...,60:68"}},
    {{"at": "{1}", "do": "set", "index": "...,{2}:{3}", "value": "{0}/values.safetensors:quarter"}},
    {{"at": "model.layers.1.self_attn.o_proj.input", "do": "scale", "by": 0.5, "index": "...,0:8"}},
    {{"at": "model.layers.1.output", "do": "save", "as": "resid"}}]}})",
                                        folder, GetParam().gate_up, half - 4, half + 4);
  auto edited = run_plan(files, folder, "edits", edits);
  auto edited_ts = run_plan(ts_files, folder, "edits_ts", edits);
  expect_close(edited, edited_ts, "edits, .pt2 vs TorchScript");
  ASSERT_EQ(edited.count("logits"), 1u);
  EXPECT_GT((edited.at("logits") - plain.at("logits")).abs().max().item<double>(), 1e-3);  // the edits acted
  testing::remove_flat_folder(folder);
}

INSTANTIATE_TEST_SUITE_P(Models, RunPt2,
                         ::testing::Values(Case{"llama_tp2_pt2", "llama_tp2", "model.layers.0.mlp.gate_up_proj.output"},
                                           Case{"llama_kv2_tp4_pt2", "llama_kv2_tp4",
                                                "model.layers.0.mlp.gate_up_proj.output"},
                                           Case{"moe_tp2_pt2", "moe_tp2",
                                                "model.layers.0.mlp.shared_expert.gate_up_proj.output"}),
                         [](const auto& info) { return std::string(info.param.pt2); });

TEST(RunPt2Refusals, AnAdHocCallIsRefusedInWords) {
  FRAG_REQUIRE_GLOO();
  FRAG_REQUIRE_NATIVERT();
  auto folder = temporary_folder();
  testing::CommandResult result;
  run_plan(pt2_files("llama_tp2_pt2"), folder, "lens", R"({"interventions": [
    {"at": "model.layers.0.output", "do": "call", "modules": ["model.norm", "lm_head"], "as": "lens"}]})",
           &result);
  EXPECT_NE(result.exit_code, 0);
  auto lines = lines_of(result.output);
  ASSERT_EQ(lines.size(), 1u) << result.output;
  EXPECT_NE(lines[0].find("needs the Python front end"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("rank0.pt2"), std::string::npos) << lines[0];
  EXPECT_FALSE(std::filesystem::exists(folder + "/lens.safetensors"));
  testing::remove_flat_folder(folder);
}

TEST(RunPt2Refusals, WithoutNativeRtAPt2IsRefusedInOneLine) {
  // A LibTorch without NativeRT (torch 2.13's wheels): frag run names the file and the way that works.
  if (FRAG_TEST_NATIVERT) GTEST_SKIP() << "this LibTorch has NativeRT: the cases above run the .pt2 files";
  FRAG_REQUIRE_GLOO();
  auto folder = temporary_folder();
  testing::CommandResult result;
  run_plan(pt2_files("llama_tp2_pt2"), folder, "plain", "", &result);
  EXPECT_NE(result.exit_code, 0);
  auto lines = lines_of(result.output);
  ASSERT_EQ(lines.size(), 1u) << result.output;
  EXPECT_NE(lines[0].find("has no NativeRT"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("fragments.load"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find(".pt2"), std::string::npos) << lines[0];
  EXPECT_FALSE(std::filesystem::exists(folder + "/plain.safetensors"));
  testing::remove_flat_folder(folder);
}

}  // namespace
}  // namespace frag
