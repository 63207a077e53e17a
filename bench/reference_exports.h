//===- bench/reference_exports.h - Where the benchmarks find their exports -*- C++ -*-===//
//
// The benchmarks' default inputs are reference exports of //tests/models,
// built by Bazel as data of the benchmark (runfiles) or found under bazel-bin/
// when run from the workspace. Header-only for the benchmark binaries.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace frag::bench {

/// `tests/models/<export>` where `<file>` exists in it: in the runfiles of `argv0`, the working
/// directory or bazel-bin/; nullopt when none has it.
inline std::optional<std::string> find_reference_export(const std::string& argv0, const std::string& export_name,
                                                        const std::string& file) {
  const std::string relative = "tests/models/" + export_name;
  std::vector<std::string> candidates;
  if (const char* dir = std::getenv("RUNFILES_DIR")) candidates.push_back(std::string(dir) + "/fragments/" + relative);
  candidates.push_back(argv0 + ".runfiles/fragments/" + relative);
  candidates.push_back(relative);
  candidates.push_back("bazel-bin/" + relative);
  if (const char* ws = std::getenv("BUILD_WORKSPACE_DIRECTORY"))
    candidates.push_back(std::string(ws) + "/bazel-bin/" + relative);
  for (const auto& c : candidates)
    if (std::filesystem::exists(c + "/" + file)) return c;
  return std::nullopt;
}

/// The same, or exit with a message naming the target to build when none exists.
inline std::string reference_export(const std::string& argv0, const std::string& export_name,
                                    const std::string& file, const std::string& program) {
  if (auto found = find_reference_export(argv0, export_name, file)) return *found;
  std::cerr << program << ": cannot find tests/models/" << export_name << "/" << file << "; build //tests/models:"
            << export_name << " or pass files\n";
  std::exit(2);
}

}  // namespace frag::bench
