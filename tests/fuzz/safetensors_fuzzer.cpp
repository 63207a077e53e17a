//===- tests/fuzz/safetensors_fuzzer.cpp - The safetensors reader ===//
#include "runtime/safetensors.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace frag;
  const std::string path = fuzz::write_input(data, size, "value.safetensors");
  return fuzz::expect_clean([&] {
    for (const auto& [name, tensor] : runtime::read_safetensors(path)) (void)tensor.sum();  // touch every byte
  });
}
