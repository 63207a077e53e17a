//===- tests/fuzz/token_ids_fuzzer.cpp - The token id file reader ===//
#include "tests/fuzz/fuzz_input.h"
#include "cli/token_ids.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace frag;
  const std::string path = fuzz::write_input(data, size, "ids.txt");
  return fuzz::expect_clean([&] { (void)cli::read_token_ids(path).sum(); });
}
