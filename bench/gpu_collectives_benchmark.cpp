//===- bench/gpu_collectives_benchmark.cpp - Host syncs and assembly on one GPU ===//
//
// What one GPU can show of issue 17 (no NCCL peer needed), side by side in one
// run, interleaved, medians:
//
// 1. Host synchronisation per collective. Two world-1 NCCL communicators on
//    the same GPU: one waits for the stream after every collective (the
//    previous execution model, FRAG_NCCL_SYNC_EACH=1), one enqueues and
//    leaves the timeout to its watchdog. Each runs a forward-shaped sequence:
//    per layer two bf16 [tokens, hidden] x [hidden, hidden] matmuls, each
//    followed by an all_reduce (the model's), and two all_gathers of save-sized
//    pieces; one synchronize() at the end, as ShardedModel's forward does.
// 2. Assembly. The 8B-shaped tp 2 rules' wholes from a gathered buffer: the
//    previous path (unbind, ir::whole_from_pieces: a narrow per part and a
//    cat) against the fused one (runtime::whole_from_gathered: one copy),
//    17 assemblies per round as 4 layers plus the logits need; bit-identity
//    checked for every rule.
//
//   gpu_collectives_benchmark [--tokens 128] [--iterations 200] [--layers 4]
//
//===----------------------------------------------------------------------===//
#include "ir/fragment_rule.h"
#include "runtime/communicator.h"
#include "runtime/whole_value.h"
#include "cli/launcher.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace frag;
  using namespace frag::runtime;
  int64_t tokens = 128;
  int iterations = 200;
  int layers = 4;
  CLI::App app{"One GPU: per-collective host sync vs watchdog (world-1 NCCL), and fused vs per-part assembly"};
  app.add_option("--tokens", tokens, "tokens per forward");
  app.add_option("--iterations", iterations, "rounds per variant");
  app.add_option("--layers", layers, "layers per forward-shaped sequence");
  CLI11_PARSE(app, argc, argv);
  if (!torch::cuda::is_available()) {
    fmt::print(stderr, "gpu_collectives_benchmark: needs a CUDA device\n");
    return 2;
  }
  const int64_t hidden = 4096;
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA, 0);

  // ---- 1. host sync per collective --------------------------------------
  if (!have_nccl()) {
    fmt::print("this build has no NCCL: part 1 skipped\n");
  } else {
    c10d::TCPStoreOptions options;
    options.port = static_cast<uint16_t>(cli::find_free_port());
    options.isServer = true;
    options.numWorkers = 1;
    auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options);
    auto synced = make_nccl_communicator(store, "synced", 0, 1, std::chrono::seconds(60), 0, true);
    auto async = make_nccl_communicator(store, "async", 0, 1, std::chrono::seconds(60), 0, false);
    auto w = torch::randn({hidden, hidden}, bf16) * 0.01;
    auto x0 = torch::randn({tokens, hidden}, bf16);
    auto qkv_piece = torch::randn({tokens, 3072}, bf16);
    auto gate_up_piece = torch::randn({tokens, 14336}, bf16);
    int64_t collectives = 0;
    auto forward = [&](Communicator& comm) {
      auto x = x0;
      std::vector<torch::Tensor> kept;
      collectives = 0;
      for (int l = 0; l < layers; ++l) {
        x = comm.all_reduce(torch::matmul(x, w));
        kept.push_back(comm.all_gather_stacked(qkv_piece));
        x = comm.all_reduce(torch::matmul(x, w));
        kept.push_back(comm.all_gather_stacked(gate_up_piece));
        collectives += 4;
      }
      comm.synchronize();
      return x;
    };
    auto compute_only = [&] {
      auto x = x0;
      for (int l = 0; l < layers; ++l) x = torch::matmul(torch::matmul(x, w), w);
      torch::cuda::synchronize();
    };
    for (int i = 0; i < 10; ++i) {
      forward(*synced);
      forward(*async);
      compute_only();
    }
    bool same = torch::equal(forward(*synced), forward(*async));
    std::vector<double> t_sync, t_async, t_compute;
    for (int i = 0; i < iterations; ++i) {
      for (int k = 0; k < 3; ++k) {  // rotate the order every round
        const int which = (i + k) % 3;
        torch::cuda::synchronize();
        const auto start = Clock::now();
        if (which == 0) forward(*synced);
        if (which == 1) forward(*async);
        if (which == 2) compute_only();
        (which == 0 ? t_sync : which == 1 ? t_async : t_compute).push_back(ms_since(start));
      }
    }
    const double s = median(t_sync), a = median(t_async), c = median(t_compute);
    fmt::print("== 1. host sync per collective (world-1 NCCL, bf16, {} tokens, {} layers, {} collectives per forward, "
               "{} rounds)\n",
               tokens, layers, collectives, iterations);
    fmt::print("    median ms per forward\n");
    fmt::print("    matmuls only, no collectives                  {:8.3f}\n", c);
    fmt::print("    sync after each collective (before)           {:8.3f}\n", s);
    fmt::print("    enqueue + watchdog, one sync per forward      {:8.3f}\n", a);
    fmt::print("    before / after                                {:8.3f}\n", s / a);
    fmt::print("    collectives' cost beyond the matmuls: before {:.3f} ms, after {:.3f} ms ({:.1f} vs {:.1f} us per "
               "collective)\n",
               s - c, a - c, 1000 * (s - c) / collectives, 1000 * (a - c) / collectives);
    fmt::print("    results equal: {}\n", same ? "yes" : "NO");
  }

  // ---- 2. assembly ------------------------------------------------------------
  struct Entry {
    std::string name;
    ir::FragmentRule rule;
    std::vector<int64_t> piece;
    int per_round;
  };
  std::vector<Entry> entries{
      {"qkv (tp 2, 8 kv heads)", ir::FragmentRule::qkv(32, 8, 128, 128, "tp", 2), {1, tokens, (16 + 4 + 4) * 128}, layers},
      {"attention out (shard -1)", ir::FragmentRule::shard(-1, "tp", 2), {1, tokens, 2048}, layers},
      {"gate_up (segments)", ir::FragmentRule::segments({14336, 14336}, {"gate", "up"}, "tp", 2), {1, tokens, 14336}, layers},
      {"mlp act (shard -1)", ir::FragmentRule::shard(-1, "tp", 2), {1, tokens, 7168}, layers},
      {"logits (vocab 32000 padded to 32128)", ir::FragmentRule::vocab_shard(32000, 32128, "tp", 2), {1, tokens, 16064}, 1},
  };
  std::vector<torch::Tensor> gathered;
  bool identical = true;
  for (const auto& e : entries) {
    std::vector<int64_t> shape{e.rule.group_size};
    shape.insert(shape.end(), e.piece.begin(), e.piece.end());
    gathered.push_back(torch::randn(shape, bf16));
    auto before = ir::whole_from_pieces(e.rule, gathered.back().unbind(0));
    auto after = whole_from_gathered(e.rule, gathered.back());
    const bool same = torch::equal(before, after);
    identical = identical && same;
    fmt::print("    {:40s} whole [{}]  bit-identical: {}\n", e.name, fmt::join(after.sizes(), ", "), same ? "yes" : "NO");
  }
  // Also kv replication (tp 16 > 8 kv heads), checked only.
  {
    auto rule = ir::FragmentRule::qkv(32, 8, 128, 128, "tp", 16);
    auto g = torch::randn({16, 1, tokens, (2 + 1 + 1) * 128}, bf16);
    const bool same = torch::equal(ir::whole_from_pieces(rule, g.unbind(0)), whole_from_gathered(rule, g));
    identical = identical && same;
    fmt::print("    {:40s} bit-identical: {}\n", "qkv (tp 16, kv replicated 2x)", same ? "yes" : "NO");
  }
  int per_round = 0;
  for (const auto& e : entries) per_round += e.per_round;
  auto round = [&](bool fused) {
    std::vector<torch::Tensor> kept;
    for (size_t i = 0; i < entries.size(); ++i)
      for (int k = 0; k < entries[i].per_round; ++k)
        kept.push_back(fused ? whole_from_gathered(entries[i].rule, gathered[i])
                             : ir::whole_from_pieces(entries[i].rule, gathered[i].unbind(0)));
    torch::cuda::synchronize();
  };
  for (int i = 0; i < 10; ++i) {
    round(false);
    round(true);
  }
  std::vector<double> t_old, t_new;
  for (int i = 0; i < iterations; ++i)
    for (int k = 0; k < 2; ++k) {
      const bool fused = (i + k) % 2 == 1;
      torch::cuda::synchronize();
      const auto start = Clock::now();
      round(fused);
      (fused ? t_new : t_old).push_back(ms_since(start));
    }
  // Per rule, the same comparison (one whole per timing, 4 back to back so launches dominate less).
  std::vector<std::pair<double, double>> per_rule;
  for (size_t e = 0; e < entries.size(); ++e) {
    std::vector<double> a, b;
    for (int i = 0; i < iterations; ++i)
      for (int k = 0; k < 2; ++k) {
        const bool fused = (i + k) % 2 == 1;
        torch::cuda::synchronize();
        const auto start = Clock::now();
        for (int rep = 0; rep < 4; ++rep)
          (void)(fused ? whole_from_gathered(entries[e].rule, gathered[e])
                       : ir::whole_from_pieces(entries[e].rule, gathered[e].unbind(0)));
        torch::cuda::synchronize();
        (fused ? b : a).push_back(ms_since(start) / 4);
      }
    per_rule.emplace_back(median(a), median(b));
  }
  const double o = median(t_old), n = median(t_new);
  fmt::print("== 2. assembly of {} wholes per round (8B-shaped tp 2 rules, bf16, {} tokens, {} rounds)\n", per_round,
             tokens, iterations);
  fmt::print("    per-part narrow + cat (before)                {:8.3f} ms  ({:.1f} us per whole)\n", o,
             1000 * o / per_round);
  fmt::print("    fused, one copy (after)                       {:8.3f} ms  ({:.1f} us per whole)\n", n,
             1000 * n / per_round);
  fmt::print("    before / after                                {:8.3f}\n", o / n);
  fmt::print("    per whole, us (before / after = ratio):\n");
  for (size_t e = 0; e < entries.size(); ++e)
    fmt::print("      {:40s} {:7.1f} / {:7.1f} = {:.2f}\n", entries[e].name, 1000 * per_rule[e].first,
               1000 * per_rule[e].second, per_rule[e].first / per_rule[e].second);
  fmt::print("    all bit-identical: {}\n", identical ? "yes" : "NO");
  return identical ? 0 : 1;
}
