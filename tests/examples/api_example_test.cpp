//===- tests/examples/api_example_test.cpp - The C++ API example runs -------===//
//
// Runs examples/api_example as two rank processes on the tp=2 export
// and as one process on the tp=1 export: both must print the same lens and
// model tokens (steering and lens agree with the unsharded model).
//
//===----------------------------------------------------------------------===//
#include "tests/support/test_support.h"
#include "cli/launcher.h"

#include <gtest/gtest.h>

#include <cctype>
#include <filesystem>
#include <future>
#include <sstream>

namespace frag {
namespace {

using testing::data_path;
using testing::model_files;
using testing::run_command;

std::string example() { return std::filesystem::absolute(data_path("examples/api_example")).string(); }

std::string folder_of(const std::string& export_name) {
  return std::filesystem::path(model_files(export_name)[0]).parent_path().string();
}

/// `out` without the log lines of torch's C++ (c10's "[W1207 08:11:25.86 socket.cpp:207] ..."): a warning the
/// machine's network can cause (a hostname not resolved in time) is not the example's output.
std::string example_output(const std::string& out) {
  std::string kept, line;
  std::istringstream lines(out);
  while (std::getline(lines, line)) {
    const bool c10_log = line.size() > 6 && line[0] == '[' && std::string("WIE").find(line[1]) != std::string::npos &&
                         std::isdigit(static_cast<unsigned char>(line[2])) && line.find("] ") != std::string::npos;
    if (!c10_log) kept += line + "\n";
  }
  return kept;
}

TEST(ApiExample, TorchLogLinesAreNotTheExamplesOutput) {
  EXPECT_EQ(example_output("[W1207 08:11:25.860791984 socket.cpp:207] [c10d] The hostname of the client socket "
                           "cannot be retrieved. err=-3\nlens layer 0: 807 196\n[not a log] line\n"),
            "lens layer 0: 807 196\n[not a log] line\n");
}

TEST(ApiExample, TwoRanksPrintWhatTheUnshardedModelPrints) {
  FRAG_REQUIRE_GLOO();
  auto whole = run_command({example(), folder_of("llama_tp1")}, {{"WORLD_SIZE", "1"}, {"RANK", "0"}});
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const std::string port = std::to_string(cli::find_free_port());
  auto launch = [&](int rank) {
    return std::async(std::launch::async, [&, rank] {
      return run_command({example(), folder_of("llama_tp2")},
                         {{"RANK", std::to_string(rank)}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                          {"MASTER_PORT", port}});
    });
  };
  auto rank0 = launch(0);
  auto rank1 = launch(1);
  auto r0 = rank0.get();
  auto r1 = rank1.get();
  ASSERT_EQ(r0.exit_code, 0) << r0.output;
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  EXPECT_NE(r0.output.find("lens layer 1:"), std::string::npos) << r0.output;
  // Same tokens; the printed norm may differ in its last digit.
  auto tokens = [](const std::string& out) {
    const std::string printed = example_output(out);
    return printed.substr(0, printed.find("mlp_in:"));
  };
  EXPECT_EQ(tokens(r0.output), tokens(whole.output));
  EXPECT_NE(r0.output.find("mlp_in: shape [1, 8, 128]"), std::string::npos) << r0.output;
  EXPECT_EQ(example_output(r1.output), "") << "only rank 0 prints";
}

}  // namespace
}  // namespace frag
