//===- tests/support/test_support.h - Paths and subprocesses for tests -*- C++ -*-===//
//
// Tests find built files (exports, the frag binary) relative to a data root:
// $FRAG_TEST_DATA if set (CMake sets it to the build folder), else the current
// folder (Bazel runs tests in their runfiles tree, where the same relative
// paths hold).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "runtime/communicator.h"

#include <chrono>
#include <map>
#include <string>
#include <vector>

/// Skips a test that runs several CPU ranks where this build has no Gloo
/// (PyTorch's pip wheels ship no gloo headers; the GPU machine's CMake build).
/// The skip is reported by GoogleTest and counted by tools/summarize_tests.py.
#define FRAG_REQUIRE_GLOO()                                                                       \
  if (!::frag::runtime::have_gloo())                                                              \
  GTEST_SKIP() << "needs several CPU ranks over Gloo, and this build has no Gloo backend "        \
                  "(built without gloo headers, as against PyTorch's pip wheels)"

/// Skips a test that needs a CUDA device.
#define FRAG_REQUIRE_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs a CUDA device; this machine has none"

namespace frag::testing {

/// `relative` under the data root.
std::string data_path(const std::string& relative);

/// The frag executable.
std::string frag_binary();

/// Rank files of a reference export, e.g. model_files("llama_tp2") -> {…/rank0.pt, …/rank1.pt}.
std::vector<std::string> model_files(const std::string& export_name);

/// A fresh empty folder for one test's outputs.
std::string temporary_folder();

struct CommandResult {
  int exit_code = -1;
  std::string output;  ///< stdout and stderr, interleaved
  std::chrono::milliseconds elapsed{0};
};

/// Runs argv[0] with argv, extra environment variables set, and a hard limit
/// (the process is killed past it and exit_code is -1).
CommandResult run_command(const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& environment = {},
                          std::chrono::seconds limit = std::chrono::seconds(120));

/// Writes `text` to `path`.
void write_text(const std::string& path, const std::string& text);

}  // namespace frag::testing
