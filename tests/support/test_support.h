//===- tests/support/test_support.h - Paths and subprocesses for tests -*- C++ -*-===//
//
// Tests find built files (exports, the frag binary) relative to a data root:
// $FRAG_TEST_DATA if set (CMake sets it to the build folder), else the current
// folder (Bazel runs tests in their runfiles tree, where the same relative
// paths hold).
//
//===----------------------------------------------------------------------===//
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

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
