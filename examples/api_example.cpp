//===- examples/api_example.cpp - Using fragments from C++ -----------===//
//
// A minimal "server" that loads one rank of a sharded model and, with the C++
// API alone (no CLI, no Python): steers the residual stream, saves a whole
// activation, and runs a logit lens at every layer. Start one process per rank
// with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), e.g.
//
//   RANK=0 WORLD_SIZE=2 MASTER_PORT=29511 api_example exports/llama_tp2 &
//   RANK=1 WORLD_SIZE=2 MASTER_PORT=29511 api_example exports/llama_tp2
//
// Rank 0 prints, per layer, the lens's top token at every position, then the
// model's own top tokens, and the norm of the saved whole MLP input.
//
//===----------------------------------------------------------------------===//
#include "ir/error.h"
#include "program/sharded_model.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: api_example EXPORT_FOLDER   (holding rank{r}.pt; one process per rank)\n";
    return 2;
  }
  using namespace frag::runtime;
  using namespace frag::program;
  try {
    auto context = RankContext::connect(RendezvousOptions::from_env());
    auto model = ShardedModel::load(context, fmt::format("{}/rank{}.pt", argv[1], context->rank()));

    // Steering: add a fixed vector to the whole residual stream after layer 0.
    // Every rank runs the same hook on the same whole tensor.
    auto steer = torch::linspace(-1.0, 1.0, 64);
    model.on("model.layers.0.output", [steer](torch::Tensor& whole, const VisitInfo&) -> std::optional<torch::Tensor> {
      return whole + steer;
    }, std::nullopt, "steer");
    // A whole read of a fragmented location (rank pieces are gathered once).
    model.save("model.layers.1.mlp.down_proj.input", "mlp_in");
    // A logit lens at every layer: norm and lm_head run ad hoc on whole tensors.
    std::vector<torch::Tensor> lens;
    for (int layer = 0; layer < 2; ++layer)
      model.on(fmt::format("model.layers.{}.output", layer),
               [&](torch::Tensor& whole, const VisitInfo&) -> std::optional<torch::Tensor> {
                 lens.push_back(model.call({"model.norm", "lm_head"}, whole));
                 return std::nullopt;
               },
               std::nullopt, "lens", /*edits=*/false);

    auto ids = torch::tensor({1, 2, 3, 4, 5, 6, 7, 8}, torch::kLong).reshape({1, 8});
    auto logits = model.forward(ids);
    if (context->rank() == 0) {
      for (size_t layer = 0; layer < lens.size(); ++layer) {
        auto top = lens[layer].argmax(-1).flatten();
        fmt::print("lens layer {}: {}\n", layer, fmt::join(std::vector<int64_t>(top.data_ptr<int64_t>(), top.data_ptr<int64_t>() + top.numel()), " "));
      }
      auto top = logits.argmax(-1).flatten();
      fmt::print("model: {}\n", fmt::join(std::vector<int64_t>(top.data_ptr<int64_t>(), top.data_ptr<int64_t>() + top.numel()), " "));
      fmt::print("mlp_in: shape [{}] norm {:.3f}\n", fmt::join(model.saved().at("mlp_in")[0].sizes(), ", "),
                 model.saved().at("mlp_in")[0].norm().item<double>());
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "api_example: error: " << e.what() << "\n";
    return 1;
  }
}
