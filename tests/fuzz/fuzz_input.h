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
#include <fstream>
#include <string>

namespace frag::fuzz {

/// A per-process scratch folder (removed by the OS's tmp cleaning; fuzz runs are short-lived).
inline const std::string& scratch() {
  static const std::string folder = [] {
    std::string pattern = "/tmp/frag-fuzz-XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) std::abort();
    return pattern;
  }();
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
