//===- tests/cli/frag_run_test.cpp - `frag run` end to end ---------------===//
//
// Runs the frag binary on reference exports made by the Python kit and checks
// that every tp=N run gives the tp=1 run's logits, on CPU over Gloo, and that
// bad input ends with a one-line error and a non-zero exit, never a hang.
//
//===----------------------------------------------------------------------===//
#include "runtime/safetensors.h"
#include "tests/support/test_support.h"
#include "cli/launcher.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>

namespace frag {
namespace {

using testing::frag_binary;
using testing::model_files;
using testing::run_command;
using testing::temporary_folder;
using testing::write_text;

/// Absolute tolerance for fp32 logits of magnitude ~5: tp=N sums in another order.
constexpr double kLogitTolerance = 1e-4;

std::string ids_file(const std::string& folder) {
  std::string path = folder + "/ids.txt";
  write_text(path, "1 2 3 4 5 6 7 8\n999 17 42 63 64 65 500 0\n");
  return path;
}

torch::Tensor run_logits(const std::vector<std::string>& files, int world, const std::string& folder) {
  std::string out = folder + "/logits_" + std::to_string(world) + ".safetensors";
  std::vector<std::string> argv{frag_binary(), "run", "--world", std::to_string(world),
                                "--input", ids_file(folder), "--out", out, "--timeout", "60"};
  argv.insert(argv.begin() + 2, files.begin(), files.end());
  auto result = run_command(argv);
  EXPECT_EQ(result.exit_code, 0) << result.output;
  return runtime::read_safetensors(out).at("logits");
}

struct Equivalence {
  const char* whole;
  const char* sharded;
};

class TpEquivalence : public ::testing::TestWithParam<Equivalence> {};

TEST_P(TpEquivalence, ShardedLogitsEqualTheTp1Logits) {
  FRAG_REQUIRE_GLOO();
  auto folder = temporary_folder();
  auto sharded_files = model_files(GetParam().sharded);
  auto expected = run_logits(model_files(GetParam().whole), 1, folder);
  auto actual = run_logits(sharded_files, static_cast<int>(sharded_files.size()), folder);
  ASSERT_EQ(expected.sizes(), (std::vector<int64_t>{2, 8, 1000}));
  ASSERT_EQ(actual.sizes(), expected.sizes());
  EXPECT_GT(expected.abs().max().item<double>(), 0.5) << "logits should not be trivial";
  EXPECT_LT((actual - expected).abs().max().item<double>(), kLogitTolerance);
}

INSTANTIATE_TEST_SUITE_P(
    ReferenceModels, TpEquivalence,
    ::testing::Values(Equivalence{"llama_tp1", "llama_tp2"}, Equivalence{"llama_tp1", "llama_tp4"},
                      Equivalence{"llama_kv2_tp1", "llama_kv2_tp4"},
                      Equivalence{"moe_tp1", "moe_tp2"}, Equivalence{"moe_tp1", "moe_tp4"},
                      Equivalence{"moe_tp1", "moe_ep_tp2"},
                      // Vocabulary padded to 192 (1152 = 3 × 384), not vLLM's default 64.
                      Equivalence{"llama_pad192_tp1", "llama_pad192_tp3"}),
    [](const auto& info) { return std::string(info.param.sharded); });

/// Runs frag and expects a one-line error containing `expected` and no output file.
void expect_failure(const std::vector<std::string>& arguments, const std::string& expected,
                    const std::map<std::string, std::string>& environment = {}) {
  auto folder = temporary_folder();
  std::string out = folder + "/out.safetensors";
  std::vector<std::string> argv{frag_binary(), "run"};
  argv.insert(argv.end(), arguments.begin(), arguments.end());
  argv.insert(argv.end(), {"--input", ids_file(folder), "--out", out});
  auto result = run_command(argv, environment, std::chrono::seconds(90));
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_NE(result.exit_code, -1) << "frag hung and was killed: " << result.output;
  EXPECT_NE(result.output.find(expected), std::string::npos) << result.output;
  EXPECT_EQ(result.output.find("terminate called"), std::string::npos) << result.output;
  EXPECT_EQ(result.output.find("Segmentation"), std::string::npos) << result.output;
  EXPECT_FALSE(std::filesystem::exists(out)) << "no output may be written on failure";
}

TEST(RunBadInput, AFileThatIsNotTorchScript) {
  auto folder = temporary_folder();
  write_text(folder + "/model.pt", "this is not a model");
  expect_failure({folder + "/model.pt"}, folder + "/model.pt: not a loadable TorchScript file");
}

TEST(RunBadInput, ATruncatedFile) {
  auto folder = temporary_folder();
  auto source = model_files("llama_tp1")[0];
  auto size = std::filesystem::file_size(source);
  std::ifstream in(source, std::ios::binary);
  std::string bytes(size / 2, '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  write_text(folder + "/half.pt", bytes);
  expect_failure({folder + "/half.pt"}, "not a loadable TorchScript file");
}

TEST(RunBadInput, RankFilesInTheWrongOrder) {
  FRAG_REQUIRE_GLOO();
  auto files = model_files("llama_tp2");
  expect_failure({"--world", "2", files[1], files[0], "--timeout", "20"},
                 "holds tp_rank 1 but was given to rank 0");
}

TEST(RunBadInput, RankFilesFromDifferentExports) {
  FRAG_REQUIRE_GLOO();
  expect_failure({"--world", "2", model_files("llama_tp2")[0], model_files("llama_seed1_tp2")[1],
                  "--timeout", "20"},
                 "rank files come from different exports");
}

TEST(RunBadInput, AWorldSizeThatDoesNotMatchTpSize) {
  expect_failure({model_files("llama_tp2")[0]}, "exported for tp_size 2 but the world size is 1");
}

TEST(RunBadInput, WrongNumberOfRankFiles) {
  auto files = model_files("llama_tp2");
  expect_failure({"--world", "3", files[0], files[1]}, "got 2 rank file(s) for a world of 3 ranks");
  // Issue 16: "a world of 1 ranks".
  expect_failure({files[0], files[1]}, "got 2 rank file(s) for a world of 1 rank: give one file per rank");
}

TEST(RunBadInput, EmptyOptionValuesNameTheOption) {
  // Issue 16: `--rules ""` and `--out ""` were taken for "none" silently, `-o ""` failed with ": cannot move the
  // temporary .tmp.<pid> into place", an empty rank file with ": cannot open the model file".
  auto folder = temporary_folder();
  const auto model = model_files("llama_tp1")[0];
  const std::string ids = ids_file(folder);
  struct Case {
    std::vector<std::string> arguments;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"run", model, "--input", ids, "--rules", ""}, "--rules: is empty: expected a rules file (JSON)"},
      {{"run", model, "--input", ids, "--plan", ""}, "--plan: is empty: expected a plan file (JSON)"},
      {{"run", model, "--input", ids, "--out", ""}, "--out: is empty: expected the safetensors file to write"},
      {{"run", model, "--input", ""}, "--input: is empty: expected a file of token ids"},
      {{"run", "", "--input", ids}, "is empty: expected a rank file"},
      {{"inspect", model, "--rules", ""}, "--rules: is empty: expected a rules file (JSON)"},
      {{"rewrite", model, "-o", ""}, "is empty: expected the file or folder to write"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.expected);
    auto result = testing::frag(c.arguments);
    EXPECT_NE(result.exit_code, 0) << result.err;
    EXPECT_NE(result.exit_code, -1) << "frag hung and was killed: " << result.err;
    EXPECT_NE(result.err.find(c.expected), std::string::npos) << result.err;
    EXPECT_TRUE(result.out.empty()) << "nothing may run: " << result.out;
  }
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(folder), std::filesystem::directory_iterator()), 1)
      << "only ids.txt: no output, no temporary";
}

TEST(RunPlans, AVisitThatNeverHappensIsAWarningPrintedOnce) {
  FRAG_REQUIRE_GLOO();
  auto folder = temporary_folder();
  write_text(folder + "/plan.json",
             R"({"interventions": [{"at": "model.layers.1.output", "do": "save", "as": "late", "visit": 4}]})");
  auto files = model_files("llama_tp2");
  auto result = run_command({frag_binary(), "run", "--world", "2", files[0], files[1], "--input", ids_file(folder),
                             "--plan", folder + "/plan.json", "--out", folder + "/out.safetensors", "--timeout", "60"});
  EXPECT_EQ(result.exit_code, 0) << result.output;
  const std::string warning = "warning: " + folder +
                              "/plan.json: visit 4 at model.layers.1.output was never reached: the last forward "
                              "visited it 1 time";
  const auto first = result.output.find(warning);
  EXPECT_NE(first, std::string::npos) << result.output;
  EXPECT_EQ(result.output.find(warning, first + 1), std::string::npos) << "printed more than once: " << result.output;
  EXPECT_EQ(runtime::read_safetensors(folder + "/out.safetensors").count("late"), 0u);
}

TEST(RunPlans, RepeatTimesForwardsAndLeavesTheResultAsOneRun) {
  // --repeat (benchmarks) runs N forwards first, each clearing and applying the plan again: the result must
  // be one run's (saves not accumulated as x.0, x.1, ...; the edit applied once), and rank 0 prints a median.
  FRAG_REQUIRE_GLOO();
  auto folder = temporary_folder();
  write_text(folder + "/plan.json", R"({"interventions": [
    {"at": "model.layers.0.mlp.down_proj.input", "do": "save", "as": "down_in"},
    {"at": "model.layers.0.output", "do": "scale", "by": 1.5, "index": ":,-1"}]})");
  auto files = model_files("llama_tp2");
  std::map<std::string, torch::Tensor> outs[2];
  for (int repeat : {0, 3}) {
    std::vector<std::string> argv{frag_binary(), "run", "--world", "2", files[0], files[1], "--input",
                                  ids_file(folder), "--plan", folder + "/plan.json", "--out",
                                  folder + "/out" + std::to_string(repeat) + ".safetensors", "--timeout", "60"};
    if (repeat > 0) argv.insert(argv.end(), {"--repeat", std::to_string(repeat)});
    auto result = run_command(argv);
    ASSERT_EQ(result.exit_code, 0) << result.output;
    const std::string line = "frag run: --repeat 3: median ";
    const auto median = result.output.find(line);
    if (repeat > 0) {
      EXPECT_NE(median, std::string::npos) << result.output;
      EXPECT_EQ(result.output.find(line, median + line.size()), std::string::npos) << "printed by more than rank 0";
    } else {
      EXPECT_EQ(median, std::string::npos) << result.output;
    }
    outs[repeat > 0] = runtime::read_safetensors(folder + "/out" + std::to_string(repeat) + ".safetensors");
  }
  ASSERT_EQ(outs[1].size(), outs[0].size());
  EXPECT_EQ(outs[1].count("down_in"), 1u);
  EXPECT_TRUE(torch::equal(outs[1].at("logits"), outs[0].at("logits")));
  EXPECT_TRUE(torch::equal(outs[1].at("down_in"), outs[0].at("down_in")));
}

TEST(RunPlans, ACallChainInTheWrongOrderNamesTheStepAndTheModule) {
  // Issue 16: modules in the wrong order failed with LibTorch's "The size of tensor a (1000) must match the size
  // of tensor b (64)", naming neither the plan step nor the module.
  auto folder = temporary_folder();
  write_text(folder + "/plan.json",
             R"({"interventions": [{"at": "model.layers.0.output", "do": "save", "as": "a"},
                                   {"at": "model.layers.1.output", "do": "call", "modules": ["lm_head", "model.norm"],
                                    "as": "lens"}]})");
  auto result = run_command({frag_binary(), "run", model_files("llama_tp1")[0], "--input", ids_file(folder), "--plan",
                             folder + "/plan.json", "--out", folder + "/out.safetensors"});
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find(folder + "/plan.json: intervention 1 (call at model.layers.1.output): calling model.norm "
                                        "(module 1 of the chain lm_head -> model.norm) on the output of lm_head of "
                                        "shape [2, 8, 1000] failed: The size of tensor a (1000) must match"),
            std::string::npos)
      << result.output;
  EXPECT_FALSE(std::filesystem::exists(folder + "/out.safetensors"));
}

/// Runs `plan` (JSON text) with frag run and returns what --out holds (logits and saves).
std::map<std::string, torch::Tensor> run_plan(const std::vector<std::string>& files, const std::string& folder,
                                              const std::string& name, const std::string& plan) {
  const std::string plan_file = folder + "/" + name + ".json", out = folder + "/" + name + ".safetensors";
  write_text(plan_file, plan);
  std::vector<std::string> argv{frag_binary(), "run", "--world", std::to_string(files.size())};
  argv.insert(argv.end(), files.begin(), files.end());
  argv.insert(argv.end(), {"--input", ids_file(folder), "--plan", plan_file, "--out", out, "--timeout", "60"});
  auto result = run_command(argv);
  EXPECT_EQ(result.exit_code, 0) << result.output;
  return result.exit_code == 0 ? runtime::read_safetensors(out) : std::map<std::string, torch::Tensor>{};
}

/// An edit of kv head 1 and saves of head regions, by "segment"/"heads" or by the index they stand for.
std::string head_plan(const std::string& edit_target, const std::string& save_k1, const std::string& save_o1) {
  const std::string qkv = "model.layers.0.self_attn.qkv_proj.output", o = "model.layers.0.self_attn.o_proj.input";
  return R"({"interventions": [
    {"at": ")" + qkv + R"(", "do": "scale", "by": 3.0, )" + edit_target + R"(},
    {"at": ")" + qkv + R"(", "do": "save", "as": "qkv"},
    {"at": ")" + qkv + R"(", "do": "save", "as": "k1", )" + save_k1 + R"(},
    {"at": ")" + o + R"(", "do": "save", "as": "o"},
    {"at": ")" + o + R"(", "do": "save", "as": "o1", )" + save_o1 + R"(}]})";
}

// llama: q 8 heads of 8 (0:64), k 4 (64:96), v 4; llama_kv2: k 2 heads (64:80), each on two of four ranks.
// Either way kv head 1 is 72:80 of qkv_proj's output, and head 1 of o_proj's input is 8:16.
class RunHeads : public ::testing::TestWithParam<const char*> {};

TEST_P(RunHeads, SegmentAndHeadsActAsTheIndexTheyStandFor) {
  FRAG_REQUIRE_GLOO();
  auto folder = temporary_folder();
  const auto files = model_files(GetParam());
  auto by_heads = run_plan(files, folder, "by_heads",
                           head_plan(R"("segment": "k", "heads": [1])", R"("segment": "k", "heads": [1])",
                                     R"("heads": [1])"));
  // The save of a segment's heads holds only them: an explicit index on a save is refused, so take it whole.
  auto by_index = run_plan(files, folder, "by_index", head_plan(R"("index": "...,72:80")", R"("segment": "k")",
                                                                R"("heads": [0, 1])"));
  auto untouched = run_plan(files, folder, "untouched",
                            head_plan(R"("index": "...,72:80", "visit": 9)", R"("segment": "k")", R"("heads": [0])"));
  ASSERT_EQ(by_heads.count("logits"), 1u);
  ASSERT_EQ(by_index.count("logits"), 1u);
  ASSERT_EQ(untouched.count("logits"), 1u);
  EXPECT_TRUE(torch::equal(by_heads.at("logits"), by_index.at("logits")));
  EXPECT_TRUE(torch::equal(by_heads.at("qkv"), by_index.at("qkv")));
  EXPECT_FALSE(torch::allclose(by_heads.at("logits"), untouched.at("logits"))) << "the edit changed nothing";

  const auto qkv = by_heads.at("qkv"), before = untouched.at("qkv");
  ASSERT_EQ(qkv.size(-1), before.size(-1));
  using torch::indexing::Ellipsis;
  using torch::indexing::Slice;
  // Only kv head 1 was scaled: 72:80 and nothing else.
  EXPECT_TRUE(torch::allclose(qkv.index({Ellipsis, Slice(72, 80)}), 3.0 * before.index({Ellipsis, Slice(72, 80)})));
  EXPECT_TRUE(torch::equal(qkv.index({Ellipsis, Slice(0, 72)}), before.index({Ellipsis, Slice(0, 72)})));
  EXPECT_TRUE(torch::equal(qkv.index({Ellipsis, Slice(80)}), before.index({Ellipsis, Slice(80)})));
  // Saves of a head or segment are the slices of the whole.
  EXPECT_TRUE(torch::equal(by_heads.at("k1"), qkv.index({Ellipsis, Slice(72, 80)})));
  EXPECT_TRUE(torch::equal(by_index.at("k1"), by_index.at("qkv").index({Ellipsis, Slice(64, 64 + (qkv.size(-1) - 64) / 2)})));
  EXPECT_TRUE(torch::equal(by_heads.at("o1"), by_heads.at("o").index({Ellipsis, Slice(8, 16)})));
  EXPECT_TRUE(torch::equal(by_index.at("o1"), by_index.at("o").index({Ellipsis, Slice(0, 16)})));
  EXPECT_TRUE(torch::equal(untouched.at("o1"), untouched.at("o").index({Ellipsis, Slice(0, 8)})));
}

INSTANTIATE_TEST_SUITE_P(ReferenceModels, RunHeads, ::testing::Values("llama_tp1", "llama_tp2", "llama_kv2_tp4"));

TEST(RunHeads, ShardedEditsOfAKvHeadGiveTheTp1Result) {
  FRAG_REQUIRE_GLOO();
  auto folder = temporary_folder();
  const auto plan = head_plan(R"("segment": "k", "heads": [1])", R"("segment": "k", "heads": [1])", R"("heads": [1])");
  // kv head 1 lives on ranks 2 and 3 of llama_kv2_tp4: the edit must land on both copies.
  auto whole = run_plan(model_files("llama_kv2_tp1"), folder, "tp1", plan);
  auto sharded = run_plan(model_files("llama_kv2_tp4"), folder, "tp4", plan);
  for (const char* name : {"logits", "qkv", "k1", "o1"}) {
    ASSERT_EQ(whole.count(name), 1u) << name;
    ASSERT_EQ(sharded.count(name), 1u) << name;
    EXPECT_LT((whole.at(name) - sharded.at(name)).abs().max().item<double>(), kLogitTolerance) << name;
  }
}

TEST(RunHeads, NegativeHeadsAreTheHeadsCountedFromTheEnd) {
  FRAG_REQUIRE_GLOO();
  auto folder = temporary_folder();
  // llama_kv2: 2 kv heads, so k head -1 is head 1 (on ranks 2 and 3 of tp 4); o_proj's input has 8: -7 is 1.
  const auto files = model_files("llama_kv2_tp4");
  auto positive = run_plan(files, folder, "positive",
                           head_plan(R"("segment": "k", "heads": [1])", R"("segment": "k", "heads": [1])",
                                     R"("heads": [1])"));
  auto negative = run_plan(files, folder, "negative",
                           head_plan(R"("segment": "k", "heads": [-1])", R"("segment": "k", "heads": [-1])",
                                     R"("heads": [-7])"));
  for (const char* name : {"logits", "qkv", "k1", "o1"}) {
    ASSERT_EQ(positive.count(name), 1u) << name;
    ASSERT_EQ(negative.count(name), 1u) << name;
    EXPECT_TRUE(torch::equal(positive.at(name), negative.at(name))) << name;
  }
  // Out of range counted from the end: refused before anything runs, naming both ranges.
  write_text(folder + "/far.json", head_plan(R"("segment": "k", "heads": [-3])", R"("segment": "k")", R"("heads": [0])"));
  auto result = run_command({frag_binary(), "run", model_files("llama_kv2_tp1")[0], "--input", ids_file(folder),
                             "--plan", folder + "/far.json"});
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.output.find("model.layers.0.self_attn.qkv_proj.output: segment k has 2 heads (0 to 1, or -2 to -1), "
                               "got head -3"),
            std::string::npos)
      << result.output;
}

TEST(RunBadInput, MalformedTokenIds) {
  auto folder = temporary_folder();
  write_text(folder + "/ids.txt", "1 2 3\n4 five 6\n");
  auto result = run_command({frag_binary(), "run", model_files("llama_tp1")[0], "--input",
                             folder + "/ids.txt"});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.output.find(folder + "/ids.txt:2: 'five' is not a token id"), std::string::npos)
      << result.output;
}

TEST(RunBadInput, ASequenceLongerThanTheModelsPositions) {
  auto folder = temporary_folder();
  std::string ids;
  for (int i = 0; i < 513; ++i) ids += std::to_string(i % 100) + (i + 1 < 513 ? " " : "\n");
  write_text(folder + "/long.txt", ids);
  auto result = run_command({frag_binary(), "run", model_files("llama_tp1")[0], "--input", folder + "/long.txt",
                             "--out", folder + "/out.safetensors"});
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("a sequence of 513 tokens is longer than the model's max_position_embeddings (512)"),
            std::string::npos)
      << result.output;
  EXPECT_FALSE(std::filesystem::exists(folder + "/out.safetensors"));
}

TEST(RunBadInput, ARankThatNeverArrivesFailsTheOthersWithinTheTimeout) {
  FRAG_REQUIRE_GLOO();
  // Rank 0 of 2 under an external launcher; rank 1 never starts.
  auto start = std::chrono::steady_clock::now();
  expect_failure({model_files("llama_tp2")[0], model_files("llama_tp2")[1], "--timeout", "2"},
                 "within 2000 ms",
                 {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                  {"MASTER_PORT", std::to_string(cli::find_free_port())}});
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

TEST(RunBadInput, AnUnreachableRendezvous) {
  expect_failure({model_files("llama_tp2")[0], model_files("llama_tp2")[1], "--timeout", "2"},
                 "rank 1: error: rendezvous at 127.0.0.1:",
                 {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                  {"MASTER_PORT", std::to_string(cli::find_free_port())}});
}

TEST(RunBadInput, ARankWhoseFileIsBadStopsEveryRankBeforeAnyCollective) {
  FRAG_REQUIRE_GLOO();
  auto folder = temporary_folder();
  write_text(folder + "/bad.pt", "garbage");
  auto files = model_files("llama_tp2");
  expect_failure({"--world", "2", files[0], folder + "/bad.pt", "--timeout", "20"},
                 "rank 0: error: rank 1: " + folder + "/bad.pt: not a loadable TorchScript file");
}

}  // namespace
}  // namespace frag
