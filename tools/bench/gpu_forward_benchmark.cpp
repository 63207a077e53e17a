//===- tools/bench/gpu_forward_benchmark.cpp - Rewritten vs original on one GPU ===//
//
// World size 1 on a CUDA device: forward time of the original export vs the
// same file rewritten in memory with nothing registered (every location's ops
// present, none waiting), and with a save at a whole location per layer.
// Runs are interleaved (A B A B …) so drift hits both alike; times are
// medians of CUDA-synchronised forwards.
//
//   gpu_forward_benchmark FILE.pt [--tokens N] [--iterations K]
//
//===----------------------------------------------------------------------===//
#include "runtime/rank_module.h"
#include "runtime/sharded_model.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <iostream>
#include <string>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  using namespace frag::runtime;
  std::string file;
  int64_t tokens = 512;
  int iterations = 20;
  CLI::App app{"One CUDA device, world size 1: forward time of an export vs the same file rewritten in memory "
               "(nothing registered, and a save at every decoder layer's output)."};
  app.add_option("file", file, "Rank file (FILE.pt) of a tp=1 export")->required()->check(CLI::ExistingFile);
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
  const torch::Device device(torch::kCUDA, 0);
  auto context = RankContext::single_rank();
  auto original = load_rank_module(file, device);
  auto rewritten = ShardedModel::load(context, file, device);
  auto saving = ShardedModel::load(context, file, device);
  int layers = 0;
  for (const auto& location : saving.table().whole)
    if (location.rfind("model.layers.", 0) == 0 && location.size() > 7 &&
        location.compare(location.size() - 7, 7, ".output") == 0 &&
        std::count(location.begin(), location.end(), '.') == 3) {
      saving.save(location, location);
      ++layers;
    }
  auto ids = torch::randint(0, 1000, {1, tokens}, torch::TensorOptions().dtype(torch::kLong)).to(device);
  auto time = [&](const std::function<void()>& f) {
    torch::cuda::synchronize();
    auto start = std::chrono::steady_clock::now();
    f();
    torch::cuda::synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  };
  std::vector<double> a, b, c;
  for (int i = 0; i < iterations + 3; ++i) {
    double ta = time([&] { run_forward(original, ids); });
    double tb = time([&] { rewritten.forward(ids); });
    double tc = time([&] {
      saving.clear_saved();
      saving.forward(ids);
    });
    if (i >= 3) {  // warm-up
      a.push_back(ta);
      b.push_back(tb);
      c.push_back(tc);
    }
  }
  const double ma = median(a), mb = median(b), mc = median(c);
  fmt::print("file {}  tokens {}  iterations {}  device {}\n", file, tokens, iterations,
             torch::cuda::device_count());
  fmt::print("{:<44} {:>10}\n", "forward (median ms)", "");
  fmt::print("{:<44} {:>10.3f}\n", "original export", ma);
  fmt::print("{:<44} {:>10.3f}   ratio {:.4f}\n", "rewritten, nothing registered", mb, mb / ma);
  fmt::print("{:<44} {:>10.3f}   ratio {:.4f}\n", fmt::format("rewritten, save at {} layer outputs", layers), mc,
             mc / ma);
  return 0;
}
