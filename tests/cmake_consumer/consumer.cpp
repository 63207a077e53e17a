//===- tests/cmake_consumer/consumer.cpp - fragments from an installed copy ===//
//
// Built by tests/cmake_consumer/CMakeLists.txt against `cmake --install`'s output. Loads one rank file
// at world 1 with the C++ API and checks what a user relies on: a read-only plan leaves the logits
// bit-identical to the file's own forward (plain torch::jit::load), a save returns the whole value, and
// an edit changes the logits. Exit 0 with one "consumer: ok" line, else 1 with what differed.
//
//===----------------------------------------------------------------------===//
#include "program/sharded_model.h"

#include <torch/script.h>

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: consumer RANK_FILE   (a tp=1 export: rank0.pt)\n";
    return 2;
  }
  using frag::program::ShardedModel;
  using frag::runtime::RankContext;
  try {
    const auto ids = torch::arange(1, 9, torch::kLong).reshape({1, 8});
    torch::NoGradGuard no_grad;
    auto original = torch::jit::load(argv[1]);
    const auto expected = original.forward({ids}).toTensor();

    auto model = ShardedModel::load(RankContext::single_rank(), argv[1]);
    model.save("model.layers.0.mlp.down_proj.input", "down_in");
    const auto logits = model.forward(ids);
    if (!torch::equal(logits, expected)) {
      std::cerr << "consumer: a read-only plan changed the logits (max difference "
                << (logits - expected).abs().max().item<double>() << ")\n";
      return 1;
    }
    const auto& saved = model.saved().at("down_in");
    if (saved.size() != 1 || saved[0].dim() != 3 || saved[0].size(1) != 8) {
      std::cerr << "consumer: expected one saved [1, 8, intermediate] tensor\n";
      return 1;
    }
    model.clear();
    model.on("model.layers.0.output",
             [](torch::Tensor& whole, const frag::runtime::VisitInfo&) -> std::optional<torch::Tensor> {
               return torch::zeros_like(whole);
             });
    if (torch::equal(model.forward(ids), expected)) {
      std::cerr << "consumer: zeroing layer 0's output left the logits unchanged\n";
      return 1;
    }
    std::cout << "consumer: ok (logits " << logits.sizes() << " bit-identical to torch::jit::load's, save "
              << saved[0].sizes() << ", edit applied)\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "consumer: error: " << e.what() << "\n";
    return 1;
  }
}
