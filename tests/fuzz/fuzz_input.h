//===- tests/fuzz/fuzz_input.h - What every fuzz target shares ---*- C++ -*-===//
//
// The readers under fuzz take paths, as the tools call them: each input is
// written to a file first. The contract under test is the project's: bad input
// ends in frag::Error (a clear message), never a crash, a hang or another
// exception. Anything else escapes LLVMFuzzerTestOneInput and libFuzzer
// reports it with the input that caused it.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/error.h"

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

namespace frag::fuzz {

/// A per-process scratch folder under $TMPDIR (else /tmp), removed at a normal exit. tools/fuzz.sh gives each
/// target a TMPDIR of its own and removes it after: a fork-mode child that dies on an input leaves its folder
/// there, not in /tmp (CI had left four folders in /tmp per run).
inline const std::string& scratch() {
  static const std::string folder = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/frag-fuzz-XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) std::abort();
    return pattern;
  }();
  // Registered once `folder` is made, so that it runs before `folder` is destroyed.
  static const bool removed_at_exit = [] {
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(scratch(), ignored);
    });
    return true;
  }();
  (void)removed_at_exit;
  return folder;
}

/// Writes the input to `name` in the scratch folder and returns its path.
inline std::string write_input(const uint8_t* data, size_t size, const std::string& name) {
  const std::string path = scratch() + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  return path;
}

/// Runs `body`; frag::Error is the expected answer to bad input, and the message must not be empty.
template <typename Body>
int expect_clean(Body&& body) {
  try {
    body();
  } catch (const frag::Error& e) {
    if (std::string(e.what()).empty()) std::abort();
  }
  return 0;
}

}  // namespace frag::fuzz
