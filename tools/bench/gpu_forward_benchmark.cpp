//===- tools/bench/gpu_forward_benchmark.cpp - Rewritten vs original on GPUs ===//
//
// One process per GPU (NCCL), or world size 1. Forward time, CUDA-synchronised,
// of six variants run interleaved in an order that rotates every iteration:
//   original      the plain rank file (no rewrite);
//   rewritten     the same file rewritten in memory, nothing registered
//                 (on GPUs ShardedModel runs the full rewrite by default);
//   layer saves   rewritten, a save at every decoder layer's output;
//   frag saves    rewritten, a save at every fragmented location of the table;
//   raw in fwd    the rewritten graph with each triple replaced by the bare
//                 NCCL collective of its piece and no other frag:: op
//                 (tools/bench/raw_collectives.h): the collectives the fragment
//                 saves need, where a hand-written model would run them;
//   specialized   rewritten, nothing registered, specialization forced on
//                 (off by default on GPUs: JIT fusers may fuse across the
//                 dropped boundaries; the run prints whether logits stay
//                 bit-identical).
// Ratios: rewritten / original (target <= 1.02) and (frag saves - rewritten) /
// (raw in fwd - rewritten) (target <= 1.15). Rank 0 prints medians.
//
//   gpu_forward_benchmark FILE.pt [--tokens N] [--iterations K]                 world size 1
//   RANK=r LOCAL_RANK=r WORLD_SIZE=N MASTER_ADDR=127.0.0.1 MASTER_PORT=P \
//     gpu_forward_benchmark 'DIR/rank{rank}.pt' ...                            one process per GPU
//
//===----------------------------------------------------------------------===//
#include "ir/fragment_table.h"
#include "passes/rewrite_for_fragments.h"
#include "runtime/rank_context.h"
#include "runtime/rank_module.h"
#include "program/sharded_model.h"
#include "tools/bench/raw_collectives.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/codegen/fuser/interface.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
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

    auto original = load_and_check_rank_module(*context, path, device);
    auto rewritten = ShardedModel::load(context, path, device);
    auto layer_saving = ShardedModel::load(context, path, device);
    auto frag_saving = ShardedModel::load(context, path, device);
    auto raw = load_and_check_rank_module(*context, path, device);
    passes::rewrite_for_fragments(raw.module, passes::LayerAliases{}, path);
    bench::replace_fragment_ops_with_raw_collectives(
        *torch::jit::toGraphFunction(raw.module.get_method("forward").function()).graph());
    // Specializing is off by default on GPUs (JIT fusers; see ShardedModel::set_specialize): timed here
    // forced on, and its logits compared below.
    auto specialized = ShardedModel::load(context, path, device);
    specialized.set_specialize(true);
    auto specialized_saving = ShardedModel::load(context, path, device);
    specialized_saving.set_specialize(true);

    int layers = 0, fragmented = 0;
    for (const auto& location : layer_saving.table().whole)
      if (location.rfind("model.layers.", 0) == 0 && location.size() > 7 &&
          location.compare(location.size() - 7, 7, ".output") == 0 &&
          std::count(location.begin(), location.end(), '.') == 3) {
        layer_saving.save(location, location);
        specialized_saving.save(location, location);
        ++layers;
      }
    for (const auto& location : frag_saving.table().fragmented_locations()) {
      frag_saving.save(location, location);
      ++fragmented;
    }

    torch::manual_seed(0);  // the same ids on every rank
    auto ids = torch::randint(0, 1000, {1, tokens}, torch::TensorOptions().dtype(torch::kLong)).to(device);
    auto time = [&](const std::function<void()>& f) {
      torch::cuda::synchronize();
      auto start = std::chrono::steady_clock::now();
      f();
      torch::cuda::synchronize();
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    };
    struct Variant {
      std::string name;
      bool fused;  // TorchScript's GPU fusers allowed while this variant's executor builds and runs its plan
      std::function<torch::Tensor()> run;
      std::vector<double> ms;
      torch::Tensor logits;
      std::string graph;  // the optimized graph the executor last ran
    };
    auto forward_of = [&](ShardedModel& m) {
      return [&m, &ids] {
        auto out = m.forward(ids);
        m.clear_saved();
        return out;
      };
    };
    // Unfused copies: the same files, every forward run with the GPU fusers off.
    auto original_u = load_and_check_rank_module(*context, path, device);
    auto specialized_u = ShardedModel::load(context, path, device);
    specialized_u.set_specialize(true);
    auto full_u = ShardedModel::load(context, path, device);
    full_u.set_specialize(false);
    auto layer_saving_u = ShardedModel::load(context, path, device);
    layer_saving_u.set_specialize(true);
    auto frag_saving_u = ShardedModel::load(context, path, device);
    frag_saving_u.set_specialize(true);
    auto all_saving_u = ShardedModel::load(context, path, device);
    all_saving_u.set_specialize(true);
    int all_locations = 0;
    for (const auto& location : layer_saving.table().whole)
      if (location.rfind("model.layers.", 0) == 0 && location.size() > 7 &&
          location.compare(location.size() - 7, 7, ".output") == 0 &&
          std::count(location.begin(), location.end(), '.') == 3)
        layer_saving_u.save(location, location);
    for (const auto& location : frag_saving_u.table().fragmented_locations()) {
      frag_saving_u.save(location, location);
      all_saving_u.save(location, location);
      ++all_locations;
    }
    for (const auto& location : all_saving_u.table().whole) {
      all_saving_u.save(location, location);
      ++all_locations;
    }
    std::vector<Variant> variants{
        {"original export", true, [&] { return run_forward(original, ids); }},
        {"rewritten, nothing registered", true, [&] { return rewritten.forward(ids); }},
        {fmt::format("rewritten, save at {} layer outputs", layers), true, forward_of(layer_saving)},
        {fmt::format("rewritten, save at {} fragmented locations", fragmented), true, forward_of(frag_saving)},
        {"raw collectives of those saves, in the forward", true,
         [&] {
           auto out = run_forward(raw, ids);
           bench::raw_kept().clear();
           return out;
         }},
        {"rewritten, specialized to no location", true, [&] { return specialized.forward(ids); }},
        {"rewritten, specialized, layer saves", true, forward_of(specialized_saving)},
        {"UNFUSED original export", false, [&] { return run_forward(original_u, ids); }},
        {"UNFUSED rewritten, specialized, nothing", false, [&] { return specialized_u.forward(ids); }},
        {"UNFUSED rewritten, full rewrite, nothing", false, [&] { return full_u.forward(ids); }},
        {"UNFUSED specialized, layer saves", false, forward_of(layer_saving_u)},
        {fmt::format("UNFUSED specialized, {} frag saves", fragmented), false, forward_of(frag_saving_u)},
        {fmt::format("UNFUSED specialized, saves at all {} locations", all_locations), false,
         forward_of(all_saving_u)},
    };
    auto run_variant = [&](Variant& v) {
      const bool before = torch::jit::canFuseOnGPU();
      torch::jit::overrideCanFuseOnGPU(v.fused);
      auto out = v.run();
      torch::jit::overrideCanFuseOnGPU(before);
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
    const char* graph_dir = std::getenv("FRAG_BENCH_GRAPH_DIR");
    fmt::print("file {}  tokens {}  iterations {}  world {}  dtype {}\n", path, tokens, iterations,
               context->world_size(), c10::toString((*original.module.parameters().begin()).scalar_type()));
    fmt::print("{:<52} {:>9} {:>9} {:>7} {:>6} {}\n", "forward (median ms, rank 0)", "ms", "/orig", "TEgroups",
               "frag::", "logits == original of its family");
    std::vector<double> med;
    for (auto& v : variants) med.push_back(median(v.ms));
    const size_t unfused0 = 7;
    for (size_t k = 0; k < n; ++k) {
      const size_t base = variants[k].fused ? 0 : unfused0;
      fmt::print("{:<52} {:>9.3f} {:>9.4f} {:>7} {:>6} {}\n", variants[k].name, med[k], med[k] / med[base],
                 count(variants[k].graph, "prim::TensorExprGroup"), count(variants[k].graph, "frag::"),
                 same(variants[k].logits, variants[base].logits));
      if (graph_dir)
        std::ofstream(fmt::format("{}/graph{:02d}.txt", graph_dir, k)) << variants[k].name << "\n" << variants[k].graph;
    }
    fmt::print("unfused original vs fused original: {}; unfused/fused original time {:.4f}\n",
               same(variants[unfused0].logits, variants[0].logits), med[unfused0] / med[0]);
    fmt::print("ratio rewritten / original: {:.4f} (target <= 1.02); specialized / original {:.4f}\n",
               med[1] / med[0], med[5] / med[0]);
    if (fragmented > 0 && med[4] > med[1])
      fmt::print("ratio (frag saves - rewritten) / (raw in fwd - rewritten): {:.3f} (target <= 1.15); extra "
                 "{:.3f} ms vs {:.3f} ms\n",
                 (med[3] - med[1]) / (med[4] - med[1]), med[3] - med[1], med[4] - med[1]);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "gpu_forward_benchmark: error: " << e.what() << "\n";
    return 1;
  }
}
