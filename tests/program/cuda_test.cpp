//===- tests/runtime/cuda_test.cpp - World size 1 on a CUDA device --------===//
//
// Runs on a machine with a GPU (the CMake build against PyTorch 2.x); skipped,
// and reported as skipped, elsewhere. The CPU run of the same export is the
// reference.
//
//===----------------------------------------------------------------------===//
#include "program/sharded_model.h"
#include "runtime/safetensors.h"
#include "tests/support/test_support.h"
#include "tools/launcher.h"

#include "runtime/collective_watchdog.h"

#include <gtest/gtest.h>
#include <atomic>
#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <thread>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/jit/codegen/fuser/interface.h>

#if __has_include(<cuda_runtime.h>)
#include <cuda_runtime.h>
#define FRAG_TEST_HAVE_CUDART 1
#endif

namespace frag::program {
namespace {

using namespace frag::runtime;

using testing::model_files;

/// fp32 on a GPU sums in other orders than on a CPU.
constexpr double kTolerance = 1e-3;

torch::Tensor token_ids() {
  return torch::tensor({1, 2, 3, 4, 5, 6, 7, 8, 999, 17, 42, 63, 64, 65, 500, 0}, torch::kLong).reshape({2, 8});
}

TEST(Cuda, NcclWithOneRankReducesAndGathers) {
  FRAG_REQUIRE_CUDA();
  if (!have_nccl()) GTEST_SKIP() << "this build has no NCCL backend";
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(tools::find_free_port());
  options.isServer = true;
  options.numWorkers = 1;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options);
  auto nccl = make_nccl_communicator(store, "test", 0, 1, std::chrono::seconds(30), 0);
  auto x = torch::arange(12, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA)).reshape({3, 4});
  EXPECT_TRUE(torch::equal(nccl->all_reduce(x).cpu(), x.cpu()));
  auto pieces = nccl->all_gather(x.to(torch::kBFloat16));
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_TRUE(torch::equal(pieces[0].cpu(), x.to(torch::kBFloat16).cpu()));
  EXPECT_EQ(nccl->collective_count(), 2);
  EXPECT_THROW(nccl->all_reduce(torch::ones({2})), frag::Error) << "CPU tensors are refused";
}

std::shared_ptr<Communicator> nccl_world_1(std::chrono::milliseconds timeout, bool sync_each = false) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(tools::find_free_port());
  options.isServer = true;
  options.numWorkers = 1;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options);
  return make_nccl_communicator(store, "test", 0, 1, timeout, 0, sync_each);
}

#ifdef FRAG_TEST_HAVE_CUDART
/// Holds the default stream (the one PyTorch and the communicator use here)
/// in a host function until release(): work queued behind it cannot run.
class StreamGate {
 public:
  StreamGate() {
    cudaSetDevice(0);
    if (cudaLaunchHostFunc(nullptr, &StreamGate::hold, this) != cudaSuccess) throw std::runtime_error("cudaLaunchHostFunc");
  }
  ~StreamGate() { release(); }
  void release() { open_ = true; }
  bool open() const { return open_; }

 private:
  static void CUDART_CB hold(void* self) {
    while (!static_cast<StreamGate*>(self)->open_) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  std::atomic<bool> open_{false};
};
#endif

TEST(Cuda, NcclCollectivesReturnBeforeTheyRunAndSynchronizeWaits) {
  FRAG_REQUIRE_CUDA();
  if (!have_nccl()) GTEST_SKIP() << "this build has no NCCL backend";
#ifndef FRAG_TEST_HAVE_CUDART
  GTEST_SKIP() << "built without cuda_runtime.h";
#else
  auto nccl = nccl_world_1(std::chrono::seconds(30));
  auto x = torch::arange(12, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA)).reshape({3, 4});
  nccl->all_reduce(x);  // first use sets the communicator up
  nccl->synchronize();
  StreamGate gate;
  std::atomic<bool> released_late{false};
  std::thread guard([&] {  // never hang: a host-synchronising collective would wait here
    std::this_thread::sleep_for(std::chrono::seconds(5));
    if (!gate.open()) released_late = true;
    gate.release();
  });
  const auto start = std::chrono::steady_clock::now();
  auto sum = nccl->all_reduce(x);
  auto stacked = nccl->all_gather_stacked(x);
  const auto returned = std::chrono::steady_clock::now() - start;
  const bool gate_was_closed = !gate.open();
  gate.release();
  guard.join();
  EXPECT_TRUE(gate_was_closed) << "the collectives waited for the stream";
  EXPECT_FALSE(released_late);
  EXPECT_LT(returned, std::chrono::seconds(2));
  nccl->synchronize();
  EXPECT_TRUE(torch::equal(sum.cpu(), x.cpu()));
  EXPECT_TRUE(torch::equal(stacked.cpu(), x.unsqueeze(0).cpu()));
#endif
}

TEST(Cuda, NcclSyncEachCollectiveWaitsForTheStream) {
  FRAG_REQUIRE_CUDA();
  if (!have_nccl()) GTEST_SKIP() << "this build has no NCCL backend";
#ifndef FRAG_TEST_HAVE_CUDART
  GTEST_SKIP() << "built without cuda_runtime.h";
#else
  auto nccl = nccl_world_1(std::chrono::seconds(30), /*sync_each=*/true);
  auto x = torch::ones({4}, torch::TensorOptions().device(torch::kCUDA));
  nccl->all_reduce(x);
  StreamGate gate;
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    gate.release();
  });
  const auto start = std::chrono::steady_clock::now();
  nccl->all_reduce(x);
  const auto returned = std::chrono::steady_clock::now() - start;
  opener.join();
  EXPECT_GE(returned, std::chrono::milliseconds(250)) << "FRAG_NCCL_SYNC_EACH mode must wait per collective";
#endif
}

TEST(Cuda, WatchdogFailsAStalledStreamWithinTheTimeout) {
  FRAG_REQUIRE_CUDA();
#ifndef FRAG_TEST_HAVE_CUDART
  GTEST_SKIP() << "built without cuda_runtime.h";
#else
  // The NCCL communicator's watchdog on real CUDA events; a stalled peer is a
  // stream that does not move (one GPU cannot hold two NCCL ranks). Abort opens it.
  StreamGate gate;
  cudaEvent_t event = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(event, nullptr), cudaSuccess);
  CollectiveWatchdog::Backend backend;
  backend.finished = [](CollectiveWatchdog::Marker m) {
    return cudaEventQuery(static_cast<cudaEvent_t>(m)) != cudaErrorNotReady;
  };
  backend.async_error = [] { return std::optional<std::string>(); };
  backend.abort = [&] { gate.release(); };
  backend.thread_start = [] { cudaSetDevice(0); };
  std::string message;
  const auto start = std::chrono::steady_clock::now();
  {
    CollectiveWatchdog watchdog(backend, std::chrono::milliseconds(300), "NCCL rank 0 of 1");
    watchdog.watch(event, "all_gather");
    try {
      watchdog.wait_all();
    } catch (const frag::Error& e) {
      message = e.what();
    }
  }
  const auto waited = std::chrono::steady_clock::now() - start;
  gate.release();
  cudaStreamSynchronize(nullptr);
  cudaEventDestroy(event);
  EXPECT_NE(message.find("all_gather #1 made no progress for 300 ms"), std::string::npos) << message;
  EXPECT_GE(waited, std::chrono::milliseconds(300));
  EXPECT_LT(waited, std::chrono::seconds(3));
#endif
}

TEST(Cuda, InterventionsOnTheGpuMatchTheCpu) {
  FRAG_REQUIRE_CUDA();
  nlohmann::json plan = nlohmann::json::array(
      {{{"at", "model.layers.0.mlp.gate_up_proj.output"}, {"do", "save"}, {"as", "gate_up"}},
       {{"at", "model.layers.0.output"}, {"do", "scale"}, {"by", 1.5}, {"index", "...,0:32"}},
       {{"at", "lm_head.output"}, {"do", "save"}, {"as", "head"}},
       {{"at", "model.layers.1.output"}, {"do", "call"}, {"modules", {"model.norm", "lm_head"}}, {"as", "lens"}}});
  auto run = [&](const torch::Device& device) {
    auto model = ShardedModel::load(RankContext::single_rank(), model_files("llama_tp1")[0], device);
    model.apply(Plan::from_json(plan, "plan", ""));
    auto logits = model.forward(token_ids().to(device)).cpu();
    SavedTensors saved;
    for (const auto& [name, tensors] : model.saved()) saved[name] = {tensors[0].cpu()};
    EXPECT_EQ(model.saved().at("gate_up")[0].device().type(), device.type());
    return std::make_pair(logits, saved);
  };
  auto [cpu_logits, cpu_saved] = run(torch::kCPU);
  auto [gpu_logits, gpu_saved] = run(torch::Device(torch::kCUDA, 0));
  EXPECT_LT((gpu_logits - cpu_logits).abs().max().item<double>(), kTolerance);
  for (const char* name : {"gate_up", "head", "lens"})
    EXPECT_LT((gpu_saved.at(name)[0] - cpu_saved.at(name)[0]).abs().max().item<double>(), kTolerance) << name;
  EXPECT_EQ(gpu_saved.at("head")[0].size(-1), 1000) << "vocab padding dropped";
}

TEST(Cuda, AReadOnlyPlanIsBitIdenticalToNoPlan) {
  FRAG_REQUIRE_CUDA();
  // The runtime's forwards run op by op on GPUs (runtime::set_gpu_fusion), so
  // neither the specialized default nor the full rewrite rounds differently
  // with a read-only plan. Each model runs three times so the profiling
  // executor has built its optimized plan.
  const torch::Device gpu(torch::kCUDA, 0);
  const nlohmann::json plan = nlohmann::json::array(
      {{{"at", "model.layers.0.output"}, {"do", "save"}, {"as", "layer0"}},
       {{"at", "model.layers.1.input"}, {"do", "save"}, {"as", "positions1"}},
       {{"at", "model.norm.output"}, {"do", "save"}, {"as", "normed"}},
       {{"at", "lm_head.output"}, {"do", "save"}, {"as", "head"}}});
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto logits_of = [&](bool with_plan, std::optional<bool> specialize) {
      auto model = ShardedModel::load(RankContext::single_rank(), model_files("llama_tp1")[0], gpu);
      model.module().to(dtype);
      if (specialize) model.set_specialize(*specialize);
      if (with_plan) model.apply(Plan::from_json(plan, "plan", ""));
      torch::Tensor logits;
      for (int i = 0; i < 3; ++i) logits = model.forward(token_ids().to(gpu)).cpu();
      return logits;
    };
    const auto plain = logits_of(false, std::nullopt);
    EXPECT_TRUE(torch::equal(logits_of(true, std::nullopt), plain)) << "a read-only plan changed the logits";
    EXPECT_TRUE(torch::equal(logits_of(true, false), plain));
    // Specialized (the default) against the full rewrite, reported.
    const auto specialized_plain = logits_of(false, true);
    const auto specialized_reading = logits_of(true, true);
    std::cout << "[ info ] " << c10::toString(dtype) << ": specialized, no plan vs full: max |diff| "
              << (specialized_plain - plain).abs().max().item<double>() << "; specialized, read-only plan vs "
              << "specialized, no plan: max |diff| " << (specialized_reading - specialized_plain).abs().max().item<double>()
              << "\n";
  }
}

TEST(Cuda, HalfPrecisionLogitsAreBitIdenticalToTheOriginal) {
  FRAG_REQUIRE_CUDA();
  // Issue 17 item 4: on a GPU in bf16 and fp16 the rewritten model, with
  // nothing registered and with read-only plans, computes the original's logits
  // bit for bit. Each forward runs three times so the profiling executor has
  // built its optimized plan (where a JIT fuser would act).
  const torch::Device gpu(torch::kCUDA, 0);
  const std::string path = model_files("llama_tp1")[0];
  auto context = RankContext::single_rank();
  auto ids = token_ids().to(gpu);
  auto last_of_three = [](const std::function<torch::Tensor()>& forward) {
    torch::Tensor logits;
    for (int i = 0; i < 3; ++i) logits = forward();
    return logits.cpu();
  };
  auto max_diff = [](const torch::Tensor& a, const torch::Tensor& b) {
    return (a.to(torch::kFloat) - b.to(torch::kFloat)).abs().max().item<double>();
  };
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto original = load_and_check_rank_module(*context, path, gpu);
    original.module.to(dtype);
    const auto expected = last_of_three([&] {
      ScopedRankContext scope(context);
      return run_forward(original, ids);
    });
    ASSERT_EQ(expected.scalar_type(), dtype);
    auto rewritten = [&](const std::function<void(ShardedModel&)>& plan) {
      auto model = ShardedModel::load(context, path, gpu);
      model.module().to(dtype);
      plan(model);
      return last_of_three([&] {
        auto logits = model.forward(ids);
        model.clear_saved();
        return logits;
      });
    };
    const auto idle = rewritten([](ShardedModel&) {});
    EXPECT_TRUE(torch::equal(idle, expected)) << "nothing registered: max |diff| " << max_diff(idle, expected);
    const auto layer_saves = rewritten([](ShardedModel& m) {
      for (const auto& location : m.table().whole)
        if (location.rfind("model.layers.", 0) == 0 && std::count(location.begin(), location.end(), '.') == 3 &&
            location.size() > 7 && location.compare(location.size() - 7, 7, ".output") == 0)
          m.save(location, location);
    });
    EXPECT_TRUE(torch::equal(layer_saves, expected))
        << "saves at layer outputs: max |diff| " << max_diff(layer_saves, expected);
    int saves = 0;
    const auto all_saves = rewritten([&](ShardedModel& m) {
      for (const auto& location : m.table().fragmented_locations()) m.save(location, location), ++saves;
      for (const auto& location : m.table().whole) m.save(location, location), ++saves;
    });
    EXPECT_GT(saves, 10);
    EXPECT_TRUE(torch::equal(all_saves, expected))
        << "saves at all " << saves << " locations: max |diff| " << max_diff(all_saves, expected);
   }
  EXPECT_TRUE(torch::jit::canFuseOnGPU()) << "LibTorch's own setting comes back after the runtime's forwards";
}

TEST(Cuda, FragRunOnTheGpuMatchesTheCpu) {
  FRAG_REQUIRE_CUDA();
  auto folder = testing::temporary_folder();
  testing::write_text(folder + "/ids.txt", "1 2 3 4 5 6 7 8\n");
  auto run = [&](const std::string& device) {
    auto out = folder + "/" + device + ".safetensors";
    auto result = testing::run_command({testing::frag_binary(), "run", model_files("moe_tp1")[0], "--input",
                                        folder + "/ids.txt", "--out", out, "--device", device});
    EXPECT_EQ(result.exit_code, 0) << result.output;
    return read_safetensors(out).at("logits");
  };
  auto cpu = run("cpu");
  auto gpu = run("cuda");
  EXPECT_LT((gpu - cpu).abs().max().item<double>(), kTolerance);
}

}  // namespace
}  // namespace frag::program
