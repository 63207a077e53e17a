//===- tests/fuzz/archive_fuzzer.cpp - Rank files (TorchScript archives) ===//
#include "runtime/rank_module.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace frag;
  const std::string path = fuzz::write_input(data, size, "rank0.pt");
  return fuzz::expect_clean([&] { runtime::load_rank_module(path); });
}
