//===- tests/cli/torch2_fixture_test.cpp - Files saved by PyTorch 2.x ---===//
//
// tests/fixtures/torch2 holds rank files exported by PyTorch 2.11 and the
// logits torch 2.11 computed with the tp=1 file. frag (this build's LibTorch)
// must load and run them, at tp=1 and tp=2, and give those logits.
//
//===----------------------------------------------------------------------===//
#include "runtime/safetensors.h"
#include "tests/support/test_support.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace frag {
namespace {

using testing::data_path;
using testing::frag_binary;
using testing::run_command;

/// Another LibTorch's CPU kernels may sum in another order.
constexpr double kTolerance = 1e-4;

std::string fixture(const std::string& relative) {
  // The fixture is a source file: under Bazel in the runfiles, under CMake in the source tree.
  std::string path = data_path("tests/fixtures/torch2/" + relative);
  if (!std::filesystem::exists(path)) path = std::string(FRAG_SOURCE_DIR) + "/tests/fixtures/torch2/" + relative;
  return std::filesystem::absolute(path).string();
}

torch::Tensor run(const std::vector<std::string>& files, const std::string& out) {
  std::vector<std::string> argv{frag_binary(), "run", "--world", std::to_string(files.size())};
  argv.insert(argv.end(), files.begin(), files.end());
  argv.insert(argv.end(), {"--input", fixture("ids.txt"), "--out", out});
  auto result = run_command(argv);
  EXPECT_EQ(result.exit_code, 0) << result.output;
  return runtime::read_safetensors(out).at("logits");
}

TEST(Torch2Fixture, Tp1FileGivesTheLogitsTorch2Computed) {
  auto expected = runtime::read_safetensors(fixture("expected_logits.safetensors")).at("logits");
  auto actual = run({fixture("llama_tp1/rank0.pt")}, testing::temporary_folder() + "/out.safetensors");
  ASSERT_EQ(actual.sizes(), expected.sizes());
  EXPECT_GT(expected.abs().max().item<double>(), 0.5);
  EXPECT_LT((actual - expected).abs().max().item<double>(), kTolerance);
}

TEST(Torch2Fixture, Tp2FilesGiveTheLogitsTorch2Computed) {
  FRAG_REQUIRE_GLOO();
  auto expected = runtime::read_safetensors(fixture("expected_logits.safetensors")).at("logits");
  auto actual = run({fixture("llama_tp2/rank0.pt"), fixture("llama_tp2/rank1.pt")},
                    testing::temporary_folder() + "/out.safetensors");
  ASSERT_EQ(actual.sizes(), expected.sizes());
  EXPECT_LT((actual - expected).abs().max().item<double>(), kTolerance);
}

}  // namespace
}  // namespace frag
