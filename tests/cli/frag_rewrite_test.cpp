//===- tests/cli/frag_rewrite_test.cpp - `frag rewrite` end to end -------===//
//
// Rewrites the reference exports with the frag binary and checks what lands on
// disk: one file to a file, several rank files into a folder, each rewritten
// file carrying its fragment table as the extra file "fragments/rules.json" and
// the frag:: ops in its forward graph; that a rewritten model run with
// `frag run` and nothing registered gives logits bit-identical to the
// original's; and that every refused or failing rewrite leaves no output and
// no temporary file behind.
//
//===----------------------------------------------------------------------===//
#include "passes/insert_fragment_ops.h"
#include "runtime/safetensors.h"
#include "tests/support/test_support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/script.h>

#include <filesystem>
#include <set>

namespace frag {
namespace {

namespace fs = std::filesystem;
using testing::frag;
using testing::FragOutput;
using testing::lines_of;
using testing::model_files;
using testing::read_text;
using testing::temporary_folder;
using testing::write_text;

constexpr const char* kRulesFile = "fragments/rules.json";
/// The hard limit on one frag command here (a rewrite of every rank, a run of
/// the rewritten files).
constexpr std::chrono::seconds kFragLimit(180);

// ---------------------------------------------------------------------------
// Running frag (testing::frag: stdout and stderr apart)

/// `frag rewrite FILES -o OUTPUT`.
FragOutput rewrite(const std::vector<std::string>& files, const std::string& output) {
  std::vector<std::string> args{"rewrite"};
  args.insert(args.end(), files.begin(), files.end());
  args.insert(args.end(), {"-o", output});
  return frag(args, kFragLimit);
}

/// Names in a folder, sorted.
std::set<std::string> listing(const std::string& folder) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(folder)) names.insert(entry.path().filename().string());
  return names;
}

/// Expects exit 1, nothing on stdout and one "frag: error: " line holding every `expected`.
void expect_error(const FragOutput& result, const std::vector<std::string>& expected) {
  EXPECT_EQ(result.exit_code, 1) << result.err;
  EXPECT_EQ(result.out, "") << "a failing rewrite reported outputs";
  auto lines = lines_of(result.err);
  ASSERT_EQ(lines.size(), 1u) << "expected one error line, got:\n" << result.err;
  EXPECT_EQ(lines[0].rfind("frag: error: ", 0), 0u) << lines[0];
  for (const auto& e : expected) EXPECT_NE(lines[0].find(e), std::string::npos) << e << "\nin: " << lines[0];
}

// ---------------------------------------------------------------------------
// Reading a rewritten file in this process (the frag:: op schemas are linked in)

struct Rewritten {
  torch::jit::Module module;
  std::string rules;   ///< extra file fragments/rules.json ("" when absent)
  std::string export_info;  ///< extra file fragkit.json
};

Rewritten load_rewritten(const std::string& path) {
  torch::jit::ExtraFilesMap extra{{kRulesFile, ""}, {"fragkit.json", ""}};
  Rewritten r;
  r.module = torch::jit::load(path, torch::kCPU, extra);
  r.rules = extra[kRulesFile];
  r.export_info = extra["fragkit.json"];
  return r;
}

void count_ops(const torch::jit::Block* block, std::map<std::string, int>& counts) {
  for (const torch::jit::Node* node : block->nodes()) {
    const std::string kind = node->kind().toQualString();
    if (kind.rfind("frag::", 0) == 0) ++counts[kind];
    for (const torch::jit::Block* inner : node->blocks()) count_ops(inner, counts);
  }
}

/// frag:: op counts in the forward a load runs: frag rewrite saves the ops in each class's methods (one
/// decoder layer's code for all layers), and loading inlines them into one forward, one op group per visit.
std::map<std::string, int> fragment_ops(torch::jit::Module module) {
  EXPECT_TRUE(frag::passes::is_rewritten_per_class(module)) << "frag rewrite saved the inlined form";
  frag::passes::inline_fragment_ops(module, "rewritten.pt");
  std::map<std::string, int> counts;
  auto& function = torch::jit::toGraphFunction(module.get_method("forward").function());
  count_ops(function.graph()->block(), counts);
  return counts;
}

nlohmann::json parse(const std::string& text) {
  try {
    return nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not JSON: " << e.what() << "\n" << text.substr(0, 300);
    return nlohmann::json::object();
  }
}

/// Checks a rewritten file against `frag inspect --json` of its original.
void expect_rewritten_like(const std::string& rewritten, const std::string& original, int64_t tp,
                           int64_t tp_rank) {
  SCOPED_TRACE(rewritten);
  Rewritten r;
  try {
    r = load_rewritten(rewritten);
  } catch (const std::exception& e) {
    FAIL() << "cannot load the rewritten file: " << e.what();
  }
  ASSERT_FALSE(r.rules.empty()) << "no extra file " << kRulesFile;
  auto table = parse(r.rules);
  EXPECT_EQ(table.value("format", ""), "fragments.table/1");
  EXPECT_EQ(table.value("tp_size", -1), tp);

  // The export's own extra file travels along.
  ASSERT_FALSE(r.export_info.empty()) << "fragkit.json was dropped";
  auto info = parse(r.export_info);
  EXPECT_EQ(info.value("tp_size", -1), tp);
  EXPECT_EQ(info.value("tp_rank", -1), tp_rank);

  // The table is the one inspect reports for the original.
  auto inspect = frag({"inspect", original, "--json"}, kFragLimit);
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  auto report = parse(inspect.out);
  ASSERT_TRUE(table["layers"].is_array());
  EXPECT_EQ(table["layers"].size(), report["layers"].size());
  EXPECT_EQ(table["whole"], report["whole"]);
  EXPECT_EQ(table["rank_local"], report["rank_local"]);
  size_t fragmented_sides = 0;
  for (const auto& layer : table["layers"])
    for (const char* side : {"input", "output"})
      if (layer.contains(side) && !layer[side].is_null()) {
        ++fragmented_sides;
        const std::string location = layer["path"].get<std::string>() + "." + side;
        bool listed = false;
        for (const auto& f : report["fragmented"])
          if (f["location"] == location) {
            listed = true;
            EXPECT_EQ(layer[side]["rule"], f["rule"]) << location;
          }
        EXPECT_TRUE(listed) << location << " is fragmented in the table but not in inspect";
      }
  EXPECT_EQ(fragmented_sides, report["fragmented"].size());

  // One gather/intervene/split triple per fragmented location, a lone
  // intervene per whole location, none at rank-local values.
  auto ops = fragment_ops(r.module);
  const int fragmented = static_cast<int>(report["fragmented"].size());
  const int whole = static_cast<int>(report["whole"].size());
  EXPECT_EQ(ops["frag::gather"], fragmented);
  EXPECT_EQ(ops["frag::split"], fragmented);
  EXPECT_EQ(ops["frag::intervene"], fragmented + whole);
}

// ---------------------------------------------------------------------------
// Writing

TEST(Rewrite, OneFileToAFile) {
  auto folder = temporary_folder();
  const auto source = model_files("llama_tp2")[0];
  const std::string target = folder + "/llama_rank0_rewritten.pt";
  auto result = rewrite({source}, target);
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(result.out, source + " -> " + target + "\n");
  EXPECT_EQ(result.err, "");
  EXPECT_EQ(listing(folder), (std::set<std::string>{"llama_rank0_rewritten.pt"}));
  expect_rewritten_like(target, source, 2, 0);
  // The original is untouched: it still has no rule table.
  torch::jit::ExtraFilesMap extra{{kRulesFile, ""}};
  torch::jit::load(source, torch::kCPU, extra);
  EXPECT_EQ(extra[kRulesFile], "");
}

TEST(Rewrite, OneFileIntoAnExistingFolder) {
  auto folder = temporary_folder();
  const auto source = model_files("moe_tp2")[1];
  auto result = rewrite({source}, folder);
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(listing(folder), (std::set<std::string>{"rank1.pt"}));
  EXPECT_EQ(result.out, source + " -> " + (fs::path(folder) / "rank1.pt").string() + "\n");
  expect_rewritten_like(folder + "/rank1.pt", source, 2, 1);
}

TEST(Rewrite, ATp1File) {
  auto folder = temporary_folder();
  const auto source = model_files("llama_tp1")[0];
  auto result = rewrite({source}, folder + "/out.pt");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  expect_rewritten_like(folder + "/out.pt", source, 1, 0);
  auto ops = fragment_ops(load_rewritten(folder + "/out.pt").module);
  // At tp 1 only the padded vocab (1024 columns, 1000 real) is a fragment.
  EXPECT_EQ(ops["frag::gather"], 2);
  EXPECT_GT(ops["frag::intervene"], 40);
}

class RewriteAllRanks : public ::testing::TestWithParam<const char*> {};

TEST_P(RewriteAllRanks, SeveralRankFilesIntoAFolder) {
  auto folder = temporary_folder();
  const auto files = model_files(GetParam());
  auto result = rewrite(files, folder);
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(result.err, "");
  std::set<std::string> expected_names;
  std::string expected_out;
  for (size_t r = 0; r < files.size(); ++r) {
    expected_names.insert("rank" + std::to_string(r) + ".pt");
    expected_out += files[r] + " -> " + (fs::path(folder) / ("rank" + std::to_string(r) + ".pt")).string() + "\n";
  }
  EXPECT_EQ(listing(folder), expected_names) << "only the rewritten files, no temporaries";
  EXPECT_EQ(result.out, expected_out);
  std::string first_rules;
  for (size_t r = 0; r < files.size(); ++r) {
    const std::string target = folder + "/rank" + std::to_string(r) + ".pt";
    expect_rewritten_like(target, files[r], static_cast<int64_t>(files.size()), static_cast<int64_t>(r));
    // The table never depends on the rank: every file carries the same one.
    auto rules = load_rewritten(target).rules;
    if (r == 0) first_rules = rules;
    EXPECT_EQ(rules, first_rules) << target;
  }
}

INSTANTIATE_TEST_SUITE_P(ReferenceModels, RewriteAllRanks,
                         ::testing::Values("llama_tp2", "llama_kv2_tp4", "moe_tp4"),
                         [](const auto& info) { return std::string(info.param); });

// ---------------------------------------------------------------------------
// Rewritten models compute exactly what the originals compute

std::string ids_file(const std::string& folder) {
  std::string path = folder + "/ids.txt";
  write_text(path, "1 2 3 4 5 6 7 8\n999 17 42 63 64 65 500 0\n");
  return path;
}

torch::Tensor run_logits(const std::vector<std::string>& files, const std::string& folder, const std::string& tag) {
  const std::string out = folder + "/logits_" + tag + ".safetensors";
  std::vector<std::string> args{"run"};
  args.insert(args.end(), files.begin(), files.end());
  args.insert(args.end(), {"--world", std::to_string(files.size()), "--input", ids_file(folder), "--out", out,
                           "--timeout", "60"});
  auto result = frag(args, kFragLimit);
  EXPECT_EQ(result.exit_code, 0) << result.out << result.err;
  if (!fs::exists(out)) {
    ADD_FAILURE() << "frag run wrote no " << out;
    return torch::Tensor();
  }
  return runtime::read_safetensors(out).at("logits");
}

class RewriteIsExact : public ::testing::TestWithParam<const char*> {};

TEST_P(RewriteIsExact, RewrittenLogitsAreBitIdenticalToTheOriginal) {
  auto folder = temporary_folder();
  auto rewritten_folder = folder + "/rewritten";
  fs::create_directory(rewritten_folder);
  const auto files = model_files(GetParam());
  if (files.size() > 1) FRAG_REQUIRE_GLOO();
  auto result = rewrite(files, rewritten_folder);
  ASSERT_EQ(result.exit_code, 0) << result.err;
  std::vector<std::string> rewritten;
  for (const auto& f : files) rewritten.push_back((fs::path(rewritten_folder) / fs::path(f).filename()).string());

  auto original_logits = run_logits(files, folder, "original");
  auto rewritten_logits = run_logits(rewritten, folder, "rewritten");
  ASSERT_TRUE(original_logits.defined() && rewritten_logits.defined());
  ASSERT_EQ(original_logits.sizes(), (std::vector<int64_t>{2, 8, 1000}));
  EXPECT_EQ(rewritten_logits.dtype(), original_logits.dtype());
  ASSERT_EQ(rewritten_logits.sizes(), original_logits.sizes());
  EXPECT_GT(original_logits.abs().max().item<double>(), 0.5) << "logits should not be trivial";
  EXPECT_TRUE(torch::equal(rewritten_logits, original_logits))
      << "max abs difference " << (rewritten_logits - original_logits).abs().max().item<double>();
}

INSTANTIATE_TEST_SUITE_P(ReferenceModels, RewriteIsExact,
                         ::testing::Values("llama_tp1", "llama_tp2", "llama_tp4", "llama_kv2_tp4", "moe_tp1",
                                           "moe_tp2", "moe_tp4", "moe_ep_tp2"),
                         [](const auto& info) { return std::string(info.param); });

// ---------------------------------------------------------------------------
// Refusals and failures leave nothing behind

TEST(RewriteRefuses, AnAlreadyRewrittenFile) {
  auto folder = temporary_folder();
  const auto source = model_files("llama_tp2")[0];
  ASSERT_EQ(rewrite({source}, folder + "/once.pt").exit_code, 0);
  auto again = rewrite({folder + "/once.pt"}, folder + "/twice.pt");
  expect_error(again, {folder + "/once.pt", "already rewritten"});
  EXPECT_EQ(listing(folder), (std::set<std::string>{"once.pt"})) << "no output, no temporary";
}

TEST(RewriteRefuses, AnAlreadyRewrittenRankAmongOriginals) {
  auto folder = temporary_folder();
  auto out = temporary_folder();
  const auto files = model_files("llama_tp2");
  ASSERT_EQ(rewrite({files[1]}, folder).exit_code, 0);
  auto again = rewrite({files[0], folder + "/rank1.pt"}, out);
  expect_error(again, {folder + "/rank1.pt", "already rewritten"});
  EXPECT_TRUE(listing(out).empty()) << "rank0 must not be written when rank1 is refused";
}

TEST(RewriteRefuses, ASecondInputThatIsNotTorchScript) {
  auto inputs = temporary_folder();
  auto out = temporary_folder();
  write_text(inputs + "/rank1.pt", "not a model");
  auto result = rewrite({model_files("llama_tp2")[0], inputs + "/rank1.pt"}, out);
  expect_error(result, {inputs + "/rank1.pt: not a loadable TorchScript file"});
  EXPECT_TRUE(listing(out).empty()) << "the first file's rewrite must not land, nor any temporary";
  EXPECT_EQ(listing(inputs), (std::set<std::string>{"rank1.pt"}));
}

TEST(RewriteRefuses, AFailureKeepsTheFilesAlreadyInTheFolder) {
  auto inputs = temporary_folder();
  auto out = temporary_folder();
  write_text(out + "/rank0.pt", "previous rank0");
  write_text(inputs + "/rank1.pt", "not a model");
  auto result = rewrite({model_files("llama_tp2")[0], inputs + "/rank1.pt"}, out);
  expect_error(result, {inputs + "/rank1.pt"});
  EXPECT_EQ(listing(out), (std::set<std::string>{"rank0.pt"}));
  EXPECT_EQ(read_text(out + "/rank0.pt"), "previous rank0");
}

TEST(RewriteRefuses, ASingleInputThatIsNotTorchScript) {
  auto inputs = temporary_folder();
  auto out = temporary_folder();
  write_text(inputs + "/model.pt", "not a model");
  auto result = rewrite({inputs + "/model.pt"}, out + "/model.pt");
  expect_error(result, {inputs + "/model.pt: not a loadable TorchScript file"});
  EXPECT_TRUE(listing(out).empty());
}

TEST(RewriteRefuses, ATruncatedInput) {
  auto inputs = temporary_folder();
  auto out = temporary_folder();
  std::string bytes = read_text(model_files("moe_tp2")[0]);
  write_text(inputs + "/rank0.pt", bytes.substr(0, bytes.size() / 3));
  auto result = rewrite({inputs + "/rank0.pt", model_files("moe_tp2")[1]}, out);
  expect_error(result, {inputs + "/rank0.pt: not a loadable TorchScript file"});
  EXPECT_TRUE(listing(out).empty());
}

TEST(RewriteRefuses, RankFilesThatDisagree) {
  auto out = temporary_folder();
  const auto a = model_files("llama_tp2")[0];
  const auto b = model_files("moe_tp2")[1];
  auto result = rewrite({a, b}, out);
  expect_error(result, {a, b, "disagree"});
  EXPECT_TRUE(listing(out).empty());
}

TEST(RewriteRefuses, SeveralInputsIntoAFolderThatDoesNotExist) {
  auto parent = temporary_folder();
  const std::string missing = parent + "/not_there";
  auto result = rewrite(model_files("llama_tp2"), missing);
  expect_error(result, {"-o " + missing + ": with 2 input files, -o must be an existing folder"});
  EXPECT_FALSE(fs::exists(missing));
  EXPECT_TRUE(listing(parent).empty()) << "nothing written beside the missing folder either";
}

TEST(RewriteRefuses, TwoInputsWithTheSameName) {
  auto out = temporary_folder();
  auto result = rewrite({model_files("llama_tp2")[0], model_files("moe_tp2")[0]}, out);
  expect_error(result, {"two input files have the same name"});
  EXPECT_TRUE(listing(out).empty());
}

TEST(RewriteRefuses, ABadRulesFile) {
  auto folder = temporary_folder();
  write_text(folder + "/rules.json", R"({"layers": {"Foo": "Bar"}})");
  auto result = frag({"rewrite", model_files("llama_tp2")[0], "-o", folder + "/out.pt", "--rules",
                      folder + "/rules.json"},
                     kFragLimit);
  expect_error(result, {folder + "/rules.json", "unknown kind \"Bar\""});
  EXPECT_EQ(listing(folder), (std::set<std::string>{"rules.json"}));
}

}  // namespace
}  // namespace frag

namespace frag {
namespace {

TEST(RewriteRefusesMore, RankFilesFromDifferentExports) {
  auto folder = testing::temporary_folder();
  auto result = testing::run_command({testing::frag_binary(), "rewrite", testing::model_files("llama_tp2")[0],
                                      testing::model_files("llama_seed1_tp2")[1], "-o", folder});
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("come from different exports"), std::string::npos) << result.output;
  EXPECT_TRUE(std::filesystem::is_empty(folder)) << "nothing written";
}

TEST(RewriteRefusesMore, AnOutputFileInAMissingFolderBeforeAnyWork) {
  auto folder = testing::temporary_folder();
  auto target = folder + "/missing/out.pt";
  auto result = testing::run_command({testing::frag_binary(), "rewrite", testing::model_files("llama_tp1")[0], "-o", target});
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("-o " + target + ": the folder " + folder + "/missing does not exist"), std::string::npos)
      << result.output;
}

}  // namespace
}  // namespace frag
