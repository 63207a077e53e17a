//===- tests/fuzz/plan_fuzzer.cpp - Plans: JSON, actions, indices, values ===//
#include "runtime/plan.h"
#include "runtime/safetensors.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace frag;
  // Plans may name "v.safetensors:v" (and other tensors, which are missing) beside them.
  static const bool values = [] {
    runtime::write_safetensors(fuzz::scratch() + "/v.safetensors", {{"v", torch::ones({4})}});
    return true;
  }();
  (void)values;
  const std::string path = fuzz::write_input(data, size, "plan.json");
  return fuzz::expect_clean([&] {
    auto plan = runtime::Plan::from_file(path);
    // Parsed indices must also select safely from a small whole.
    for (const auto& step : plan.steps)
      if (step.index) step.index->select(torch::zeros({2, 3, 4}), step.at);
  });
}
