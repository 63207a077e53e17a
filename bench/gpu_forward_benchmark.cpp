//===- bench/gpu_forward_benchmark.cpp - Rewritten vs original on GPUs ===//
//
// One process per GPU (NCCL), or world size 1. Forward time, CUDA-synchronised,
// of twelve variants run interleaved in an order that rotates every iteration,
// each on its own copy of the file, in two families:
//   op by op (the runtime's default, runtime::set_gpu_fusion off): the original
//     export; rewritten with nothing registered (specialized: the default);
//     the full rewrite (every location's ops); saves at every decoder layer's
//     output, at every fragmented location, at every location; and the raw
//     collectives of the fragmented saves in the forward (each triple replaced
//     by the bare NCCL collective of its piece, bench/raw_collectives.h);
//   FUSED (TorchScript's GPU fusers on, LibTorch's default and this runtime's
//     before issue 17 item 4): the original; full rewrite and specialized, each
//     with nothing registered and with layer saves.
//   GRAPH (CUDA graphs, ShardedModel's default on GPUs): the original's forward
//     captured by this benchmark (runtime::CudaGraph); rewritten with nothing
//     registered, and with saves at the layer outputs, at every fragmented
//     location and at every location, each replayed by ShardedModel.
// Each variant's logits are compared with its family's original (bit for bit)
// and its optimized graph's TensorExpr groups and frag:: ops counted
// (FRAG_BENCH_GRAPH_DIR=DIR writes the graphs). Ratios: rewritten / original
// (target <= 1.01), saves / original, op by op / fused original, and
// (frag saves - rewritten) / (raw in fwd - rewritten) (target <= 1.15). Rank 0 prints medians.
//
//   gpu_forward_benchmark FILE.pt [--tokens N] [--iterations K]                 world size 1
//   RANK=r LOCAL_RANK=r WORLD_SIZE=N MASTER_ADDR=127.0.0.1 MASTER_PORT=P \
//     gpu_forward_benchmark 'DIR/rank{rank}.pt' ...                            one process per GPU
//
//===----------------------------------------------------------------------===//
#include "ir/fragment_table.h"
#include "passes/rewrite_for_fragments.h"
#include "runtime/cuda_graph.h"
#include "runtime/rank_context.h"
#include "runtime/rank_module.h"
#include "program/sharded_model.h"
#include "bench/raw_collectives.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string for_rank(std::string path, int rank) {
  const auto at = path.find("{rank}");
  if (at != std::string::npos) path.replace(at, 6, std::to_string(rank));
  return path;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace frag;
  using namespace frag::runtime;
  using namespace frag::program;
  std::string file;
  int64_t tokens = 512;
  int iterations = 20;
  CLI::App app{"CUDA, one process per GPU over NCCL (or world size 1): forward time of an export vs the same "
               "file rewritten in memory, with saves, and with the raw collectives the saves need."};
  app.add_option("file", file, "Rank file; with WORLD_SIZE > 1 a path containing {rank}")->required();
  app.add_option("--tokens", tokens, "Tokens in the one input sequence (the reference Llama holds 512 positions)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--iterations", iterations, "Measured forwards of each kind, after 3 warm-up rounds")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (!torch::cuda::is_available()) {
    std::cerr << "gpu_forward_benchmark: no CUDA device\n";
    return 1;
  }
  try {
    const char* world_env = std::getenv("WORLD_SIZE");
    const bool distributed = world_env != nullptr && std::atoi(world_env) > 1;
    std::shared_ptr<RankContext> context;
    int local_rank = 0;
    if (distributed) {
      auto options = RendezvousOptions::from_env();
      options.backend = "nccl";
      local_rank = options.local_rank;
      context = RankContext::connect(options);
    } else {
      context = RankContext::single_rank();
    }
    ScopedRankContext scope(context);  // the original's and the raw graph's own collectives
    const int rank = context->rank();
    const std::string path = for_rank(file, rank);
    const torch::Device device(torch::kCUDA, local_rank);

    torch::manual_seed(0);  // the same ids on every rank
    auto ids = torch::randint(0, 1000, {1, tokens}, torch::TensorOptions().dtype(torch::kLong)).to(device);
    auto time = [&](const std::function<void()>& f) {
      torch::cuda::synchronize();
      auto start = std::chrono::steady_clock::now();
      f();
      torch::cuda::synchronize();
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    };
    enum Family { kFused, kOpByOp, kGraph };
    struct Variant {
      std::string name;
      Family family;  // kFused: runtime::set_gpu_fusion on while it runs (its executor builds its plan so)
      std::function<torch::Tensor()> run;
      std::vector<double> ms;
      torch::Tensor logits;
      std::string graph;  // the optimized graph its executor last ran
    };
    // Each variant its own copy of the file: an executor builds its plan (fused or not) once, under the
    // setting of runtime::set_gpu_fusion at its first forwards.
    auto original = load_and_check_rank_module(*context, path, device);
    auto original_fused = load_and_check_rank_module(*context, path, device);
    auto raw = load_and_check_rank_module(*context, path, device);
    passes::rewrite_for_fragments(raw.module, passes::LayerAliases{}, path);
    bench::replace_fragment_ops_with_raw_collectives(
        *torch::jit::toGraphFunction(raw.module.get_method("forward").function()).graph());
    std::vector<std::unique_ptr<ShardedModel>> models;
    auto model = [&](bool specialize, bool graphs = false) -> ShardedModel& {
      models.push_back(std::make_unique<ShardedModel>(ShardedModel::load(context, path, device)));
      models.back()->set_specialize(specialize);
      models.back()->set_cuda_graphs(graphs);
      return *models.back();
    };
    std::vector<std::string> layer_outputs;
    for (const auto& location : model(true).table().whole)
      if (location.rfind("model.layers.", 0) == 0 && location.size() > 7 &&
          location.compare(location.size() - 7, 7, ".output") == 0 &&
          std::count(location.begin(), location.end(), '.') == 3)
        layer_outputs.push_back(location);
    const auto fragmented_locations = models.back()->table().fragmented_locations();
    std::vector<std::string> all_locations = fragmented_locations;
    for (const auto& location : models.back()->table().whole) all_locations.push_back(location);
    auto saving = [&](bool specialize, const std::vector<std::string>& locations, bool graphs = false) -> ShardedModel& {
      auto& m = model(specialize, graphs);
      for (const auto& location : locations) m.save(location, location);
      return m;
    };
    auto forward_of = [&](ShardedModel& m) {
      return [&m, &ids] {
        auto out = m.forward(ids);
        m.clear_saved();
        return out;
      };
    };
    // The original's forward in a CUDA graph, as a peer would capture it: two eager forwards, then captured.
    auto original_graphed = load_and_check_rank_module(*context, path, device);
    std::unique_ptr<CudaGraph> original_graph;
    torch::Tensor graph_ids = ids.clone(), graph_logits;
    int original_graph_runs = 0;
    auto original_replayed = [&] {
      if (original_graph == nullptr && ++original_graph_runs <= 2) return run_forward(original_graphed, graph_ids);
      if (original_graph == nullptr)
        original_graph = std::make_unique<CudaGraph>([&] { graph_logits = run_forward(original_graphed, graph_ids); });
      graph_ids.copy_(ids);
      original_graph->replay();
      return graph_logits.clone();
    };
    std::vector<Variant> variants{
        // LibTorch's default: GPU fusers on (runtime::set_gpu_fusion(true)); the full rewrite was the GPU default.
        {"FUSED original export", kFused, [&] { return run_forward(original_fused, ids); }},
        {"FUSED full rewrite, nothing registered", kFused, forward_of(model(false))},
        {fmt::format("FUSED full rewrite, saves at {} layer outputs", layer_outputs.size()), kFused,
         forward_of(saving(false, layer_outputs))},
        {"FUSED specialized, nothing registered", kFused, forward_of(model(true))},
        {"FUSED specialized, layer saves", kFused, forward_of(saving(true, layer_outputs))},
        // Op by op on GPUs, specialized, eager (set_cuda_graphs(false)).
        {"original export", kOpByOp, [&] { return run_forward(original, ids); }},
        {"rewritten, nothing registered", kOpByOp, forward_of(model(true))},
        {"full rewrite, nothing registered", kOpByOp, forward_of(model(false))},
        {fmt::format("rewritten, saves at {} layer outputs", layer_outputs.size()), kOpByOp,
         forward_of(saving(true, layer_outputs))},
        {fmt::format("rewritten, saves at {} fragmented locations", fragmented_locations.size()), kOpByOp,
         forward_of(saving(true, fragmented_locations))},
        {fmt::format("rewritten, saves at all {} locations", all_locations.size()), kOpByOp,
         forward_of(saving(true, all_locations))},
        {"raw collectives of the fragmented saves, in the forward", kOpByOp,
         [&] {
           auto out = run_forward(raw, ids);
           bench::raw_kept().clear();
           return out;
         }},
        // The runtime's default on GPUs: op by op, specialized, replayed from CUDA graphs.
        {"GRAPH original export, captured", kGraph, original_replayed},
        {"GRAPH rewritten, nothing registered", kGraph, forward_of(model(true, true))},
        {fmt::format("GRAPH rewritten, saves at {} layer outputs", layer_outputs.size()), kGraph,
         forward_of(saving(true, layer_outputs, true))},
        {fmt::format("GRAPH rewritten, saves at {} fragmented locations", fragmented_locations.size()), kGraph,
         forward_of(saving(true, fragmented_locations, true))},
        {fmt::format("GRAPH rewritten, saves at all {} locations", all_locations.size()), kGraph,
         forward_of(saving(true, all_locations, true))},
    };
    const size_t unfused0 = 5, idle = 6, layer_saves = 8, frag_saves = 9, all_saves = 10, raw_fwd = 11;
    const size_t graph0 = 12, graph_idle = 13, graph_layer_saves = 14, graph_frag_saves = 15, graph_all_saves = 16;
    const size_t first_of[] = {0, unfused0, graph0};
    auto run_variant = [&](Variant& v) {
      set_gpu_fusion(v.family == kFused);
      auto out = v.run();
      set_gpu_fusion(false);
      return out;
    };
    const size_t n = variants.size();
    for (int i = 0; i < iterations + 3; ++i)
      for (size_t k = 0; k < n; ++k) {
        auto& v = variants[(i + k) % n];
        const double ms = time([&] { run_variant(v); });
        if (i >= 3) v.ms.push_back(ms);
      }
    // Logits after the executors have built their optimized plans (all ranks take part).
    for (auto& v : variants) {
      v.logits = run_variant(v);
      if (auto graph = torch::jit::lastExecutedOptimizedGraph()) v.graph = graph->toString();
    }
    if (rank != 0) return 0;
    auto same = [](const torch::Tensor& a, const torch::Tensor& b) {
      return torch::equal(a, b) ? std::string("yes")
                                : fmt::format("NO (max |diff| {:.3g})", (a.to(torch::kFloat) - b.to(torch::kFloat))
                                                                            .abs()
                                                                            .max()
                                                                            .item<double>());
    };
    auto count = [](const std::string& text, const std::string& what) {
      size_t c = 0;
      for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++c;
      return c;
    };
    const char* graph_dir = std::getenv("FRAG_BENCH_GRAPH_DIR");  // optimized graphs, one file per variant
    fmt::print("file {}  tokens {}  iterations {}  world {}  dtype {}\n", path, tokens, iterations,
               context->world_size(), c10::toString((*original.module.parameters().begin()).scalar_type()));
    fmt::print("{:<56} {:>8} {:>7} {:>9} {:>6}  {}\n", "forward (median ms, rank 0)", "ms", "/orig", "TE groups",
               "frag::", "logits equal to its family's original");
    std::vector<double> med;
    med.reserve(variants.size());
    for (auto& v : variants) med.push_back(median(v.ms));
    for (size_t k = 0; k < n; ++k) {
      const size_t base = first_of[variants[k].family];
      fmt::print("{:<56} {:>8.3f} {:>7.4f} {:>9} {:>6}  {}\n", variants[k].name, med[k], med[k] / med[base],
                 count(variants[k].graph, "prim::TensorExprGroup_"), count(variants[k].graph, "frag::"),
                 same(variants[k].logits, variants[base].logits));
      if (graph_dir)
        std::ofstream(fmt::format("{}/graph{:02d}.txt", graph_dir, k)) << variants[k].name << "\n" << variants[k].graph;
    }
    bool identical = true;
    for (size_t k = unfused0; k < variants.size(); ++k)
      identical = identical && (k == raw_fwd || torch::equal(variants[k].logits, variants[unfused0].logits));
    fmt::print("bit-identical to the original (nothing registered, read-only plans, full rewrite, CUDA graphs): {}\n",
               identical ? "yes" : "NO");
    fmt::print("op by op vs fused original: time {:.4f}x, logits {}\n", med[unfused0] / med[0],
               same(variants[unfused0].logits, variants[0].logits));
    fmt::print("ratio rewritten / original: {:.4f} (target <= 1.01); layer saves {:.4f}; all saves {:.4f}\n",
               med[idle] / med[unfused0], med[layer_saves] / med[unfused0], med[all_saves] / med[unfused0]);
    if (!fragmented_locations.empty() && med[raw_fwd] > med[idle])
      fmt::print("ratio (frag saves - rewritten) / (raw in fwd - rewritten): {:.3f} (target <= 1.15); extra "
                 "{:.3f} ms vs {:.3f} ms\n",
                 (med[frag_saves] - med[idle]) / (med[raw_fwd] - med[idle]), med[frag_saves] - med[idle],
                 med[raw_fwd] - med[idle]);
    fmt::print("CUDA graphs: captured original / op by op original {:.4f}; replayed rewritten / captured original "
               "{:.4f} (idle), {:.4f} (layer saves), {:.4f} (fragmented saves), {:.4f} (all saves); replayed rewritten "
               "/ op by op original {:.4f}\n",
               med[graph0] / med[unfused0], med[graph_idle] / med[graph0], med[graph_layer_saves] / med[graph0],
               med[graph_frag_saves] / med[graph0], med[graph_all_saves] / med[graph0], med[graph_idle] / med[unfused0]);
    // The GRAPH variants' models are the last ones made: each must have replayed, not run eagerly.
    for (size_t k = models.size() - (variants.size() - graph0 - 1); k < models.size(); ++k) {
      const auto& stats = models[k]->graph_stats();
      fmt::print("  graph model {}: captures {}, replays {}, refused {}\n", k, stats.captures, stats.replays,
                 stats.refusals);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "gpu_forward_benchmark: error: " << e.what() << "\n";
    return 1;
  }
}
