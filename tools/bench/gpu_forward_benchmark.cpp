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

#include <fmt/format.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  using namespace frag::runtime;
  if (argc < 2) {
    std::cerr << "usage: gpu_forward_benchmark FILE.pt [--tokens N] [--iterations K]\n";
    return 2;
  }
  int64_t tokens = 512;
  int iterations = 20;
  for (int i = 2; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--tokens") tokens = std::stoll(argv[i + 1]);
    if (std::string(argv[i]) == "--iterations") iterations = std::stoi(argv[i + 1]);
  }
  if (!torch::cuda::is_available()) {
    std::cerr << "gpu_forward_benchmark: no CUDA device\n";
    return 1;
  }
  const torch::Device device(torch::kCUDA, 0);
  auto context = RankContext::single_rank();
  auto original = load_rank_module(argv[1], device);
  auto rewritten = ShardedModel::load(context, argv[1], device);
  auto saving = ShardedModel::load(context, argv[1], device);
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
  fmt::print("file {}  tokens {}  iterations {}  device {}\n", argv[1], tokens, iterations,
             torch::cuda::device_count());
  fmt::print("{:<44} {:>10}\n", "forward (median ms)", "");
  fmt::print("{:<44} {:>10.3f}\n", "original export", ma);
  fmt::print("{:<44} {:>10.3f}   ratio {:.4f}\n", "rewritten, nothing registered", mb, mb / ma);
  fmt::print("{:<44} {:>10.3f}   ratio {:.4f}\n", fmt::format("rewritten, save at {} layer outputs", layers), mc,
             mc / ma);
  return 0;
}
