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
#include "cli/launcher.h"

#include "runtime/collective_watchdog.h"
#include "runtime/cuda_graph.h"

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
  options.port = static_cast<uint16_t>(cli::find_free_port());
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
  options.port = static_cast<uint16_t>(cli::find_free_port());
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

TEST(Cuda, CpuIdsRunOnACudaModel) {
  // A C++ caller's CPU ids: ShardedModel moves them to the model's device (it raised a device error).
  FRAG_REQUIRE_CUDA();
  const torch::Device gpu(torch::kCUDA, 0);
  auto model = ShardedModel::load(RankContext::single_rank(), model_files("llama_tp1")[0], gpu);
  const auto on_gpu = model.forward(token_ids().to(gpu));
  EXPECT_TRUE(torch::equal(model.forward(token_ids()), on_gpu));
  EXPECT_EQ(model.generate(token_ids(), 2).size(1), token_ids().size(1) + 2);
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


// ---- CUDA graphs (issue 17, item 2) -------------------------------------------------------------

#define FRAG_REQUIRE_CUDA_GRAPHS()                                                            \
  do {                                                                                        \
    FRAG_REQUIRE_CUDA();                                                                      \
    if (!CudaGraph::available()) GTEST_SKIP() << "this build cannot capture CUDA graphs (no c10_cuda)"; \
  } while (0)

/// Token ids of `batch` x `length`, different for each `round`: a replay must read the new ids.
torch::Tensor round_ids(int64_t round, int64_t batch = 2, int64_t length = 8) {
  return (torch::arange(batch * length, torch::kLong).reshape({batch, length}) * (7 + round) + 3 * round) % 1000;
}

TEST(Cuda, ACapturedForwardReplaysWhatTheEagerForwardComputesBitForBit) {
  FRAG_REQUIRE_CUDA_GRAPHS();
  const torch::Device gpu(torch::kCUDA, 0);
  auto folder = testing::temporary_folder();
  // Saves (whole, fragmented, indexed, one visit) and every edit kind, at fragmented and whole locations.
  const nlohmann::json plan = nlohmann::json::array(
      {{{"at", "model.layers.0.mlp.gate_up_proj.output"}, {"do", "save"}, {"as", "gate_up"}},
       {{"at", "model.layers.0.self_attn.qkv_proj.output"}, {"do", "zero"}, {"index", "...,0:8"}},
       {{"at", "model.layers.0.output"}, {"do", "scale"}, {"by", 1.5}, {"index", "...,0:32"}},
       {{"at", "model.layers.0.output"}, {"do", "save"}, {"as", "layer0"}},
       {{"at", "model.layers.1.mlp.down_proj.input"}, {"do", "add"}, {"value", "v.safetensors:v"}},
       {{"at", "model.layers.1.self_attn.o_proj.input"}, {"do", "set"}, {"value", "v.safetensors:v"},
        {"index", "...,0:4"}, {"visit", 0}},
       {{"at", "model.norm.output"}, {"do", "save"}, {"as", "normed"}},
       {{"at", "lm_head.output"}, {"do", "save"}, {"as", "head"}},
       // A call step: the chain's kernels and its vocab all-gather are captured with the forward.
       {{"at", "model.layers.0.output"}, {"do", "call"}, {"modules", {"model.norm", "lm_head"}}, {"as", "lens"}}});
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    write_safetensors(folder + "/v.safetensors", {{"v", torch::full({1}, 0.25).to(dtype)}});
    auto eager = ShardedModel::load(RankContext::single_rank(), model_files("llama_tp1")[0], gpu);
    auto graphed = ShardedModel::load(RankContext::single_rank(), model_files("llama_tp1")[0], gpu);
    eager.set_cuda_graphs(false);
    for (auto* model : {&eager, &graphed}) {  // hooks keep the model's address: registered where it stays
      model->module().to(dtype);
      model->apply(Plan::from_json(plan, "plan", folder));
    }
    // Rounds 0-1 run eagerly, round 2 captures and replays, 3-4 replay; round 5 is a new shape (eager).
    // (In fp32 the executor's fusers act from its second run on, so eager rounds compare run for run.)
    for (int64_t round = 0; round < 6; ++round) {
      SCOPED_TRACE("round " + std::to_string(round));
      auto ids = (round == 5 ? round_ids(round, 1, 5) : round_ids(round)).to(gpu);
      auto expected = eager.forward(ids);
      auto logits = graphed.forward(ids);
      EXPECT_TRUE(torch::equal(logits, expected))
          << "max |diff| " << (logits.to(torch::kFloat) - expected.to(torch::kFloat)).abs().max().item<double>();
      for (const char* name : {"gate_up", "layer0", "normed", "head", "lens"}) {
        ASSERT_EQ(graphed.saved().at(name).size(), static_cast<size_t>(round + 1)) << name;
        EXPECT_TRUE(torch::equal(graphed.saved().at(name).back(), eager.saved().at(name).back())) << name;
      }
      for (const char* location : {"model.layers.0.output", "model.layers.1.self_attn.o_proj.input"})
        EXPECT_EQ(graphed.interventions().visits_at(location), eager.interventions().visits_at(location));
      EXPECT_EQ(graphed.unreached_visits(), eager.unreached_visits());
    }
    // Saves outlive the next replay: round 2's copy still holds round 2's values.
    EXPECT_FALSE(torch::equal(graphed.saved().at("head")[2], graphed.saved().at("head")[3]));
    EXPECT_TRUE(torch::equal(graphed.saved().at("head")[2], eager.saved().at("head")[2]));
    const auto& stats = graphed.graph_stats();
    EXPECT_EQ(stats.captures, 1);
    EXPECT_EQ(stats.replays, 3) << "rounds 2, 3 and 4";
    EXPECT_EQ(stats.refusals, 0);
    EXPECT_EQ(eager.graph_stats().captures, 0);
  }
  testing::remove_flat_folder(folder);
}

TEST(Cuda, ForwardsWithCallbacksRunEagerlyAndAChangeOfPlanCapturesAgain) {
  FRAG_REQUIRE_CUDA_GRAPHS();
  const torch::Device gpu(torch::kCUDA, 0);
  auto model = ShardedModel::load(RankContext::single_rank(), model_files("llama_tp1")[0], gpu);
  int calls = 0;
  model.on("model.layers.0.output", [&](torch::Tensor& whole, const VisitInfo&) -> std::optional<torch::Tensor> {
    ++calls;
    whole.mul_(2);
    return std::nullopt;
  });
  auto ids = round_ids(0).to(gpu);
  for (int i = 0; i < 4; ++i) model.forward(ids);
  EXPECT_EQ(calls, 4) << "a C++ callback runs on every forward";
  EXPECT_EQ(model.graph_stats().captures, 0);
  model.clear();
  model.save("model.layers.1.output", "layer1");
  model.forward(ids);  // the executor's profiling run (fp32: it fuses from the next run on)
  const auto plain = model.forward(ids);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(torch::equal(model.forward(ids), plain));
  EXPECT_EQ(model.graph_stats().captures, 1);
  EXPECT_EQ(model.graph_stats().replays, 2);
  // Another plan: its third forward captures its own.
  model.save("model.layers.0.output", "layer0");
  for (int i = 0; i < 3; ++i) model.forward(ids);
  EXPECT_EQ(model.graph_stats().captures, 2);
  EXPECT_EQ(model.saved().at("layer0").size(), 3u);
  EXPECT_EQ(model.saved().at("layer1").size(), 7u);
  // The first plan registered again (as Python registers a trace's plan per forward) finds its graph.
  model.clear();
  model.save("model.layers.1.output", "layer1");
  EXPECT_TRUE(torch::equal(model.forward(ids), plain));
  EXPECT_EQ(model.graph_stats().captures, 2);
  EXPECT_EQ(model.graph_stats().replays, 4);
  EXPECT_EQ(model.saved().at("layer1").size(), 8u);
  // So does a change of the weights' storage: bf16 weights are a new capture, not a replay of fp32 ones.
  model.module().to(torch::kBFloat16);
  model.forward(ids);
  auto bf16 = model.forward(ids);
  EXPECT_EQ(bf16.scalar_type(), torch::kBFloat16);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(torch::equal(model.forward(ids), bf16));
  EXPECT_EQ(model.graph_stats().captures, 3);
  EXPECT_EQ(model.graph_stats().replays, 6);
}

TEST(Cuda, ACaptureCudaRefusesIsAbandonedCleanly) {
  FRAG_REQUIRE_CUDA_GRAPHS();
  auto x = torch::ones({4}, torch::TensorOptions().device(torch::kCUDA));
  // Reading a value back needs the host: CUDA refuses it inside a capture.
  try {
    CudaGraph refused([&] { (void)x.sum().item<float>(); });
    FAIL() << "the capture should have been refused";
  } catch (const frag::Error& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA graph capture failed"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(CudaGraph::capturing());
  // Nothing is left behind: eager work and a new capture work.
  EXPECT_EQ(x.sum().item<float>(), 4.0f);
  torch::Tensor out;
  CudaGraph graph([&] { out = x * 2; });
  x.fill_(3);
  graph.replay();
  EXPECT_TRUE(torch::equal(out.cpu(), torch::full({4}, 6.0f)));
}

TEST(Cuda, NcclCollectivesReplayFromACudaGraphAndTheReplayIsWatched) {
  FRAG_REQUIRE_CUDA_GRAPHS();
  if (!have_nccl()) GTEST_SKIP() << "this build has no NCCL backend";
  auto nccl = nccl_world_1(std::chrono::seconds(30));
  ASSERT_TRUE(nccl->capturable());
  auto x = torch::arange(6, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA)).reshape({2, 3});
  nccl->all_reduce(x);  // first use sets the communicator up, outside the capture
  nccl->synchronize();
  torch::Tensor sum, stacked;
  CudaGraph graph([&] {
    sum = nccl->all_reduce(x);
    stacked = nccl->all_gather_stacked(x * 2);
  });
  EXPECT_EQ(nccl->collective_count(), 3);
  for (float k : {1.0f, -4.0f}) {
    x.fill_(k);
    graph.replay();
    nccl->watch_replay();
    nccl->synchronize();
    EXPECT_TRUE(torch::equal(sum.cpu(), torch::full({2, 3}, k)));
    EXPECT_TRUE(torch::equal(stacked.cpu(), torch::full({1, 2, 3}, 2 * k)));
  }
  EXPECT_FALSE(nccl_world_1(std::chrono::seconds(30), /*sync_each=*/true)->capturable())
      << "a communicator that waits after each collective cannot be captured";
}

TEST(Cuda, AMoeForwardIsCapturedOrRunsEagerlyAndEitherWayMatches) {
  FRAG_REQUIRE_CUDA_GRAPHS();
  // The kit's MoE routes tokens to experts; whether its forward reads tensor values to branch decides
  // whether CUDA can capture it. Either way the results equal the eager forward's.
  const torch::Device gpu(torch::kCUDA, 0);
  auto eager = ShardedModel::load(RankContext::single_rank(), model_files("moe_tp1")[0], gpu);
  eager.set_cuda_graphs(false);
  auto graphed = ShardedModel::load(RankContext::single_rank(), model_files("moe_tp1")[0], gpu);
  for (auto* model : {&eager, &graphed}) model->save("lm_head.output", "head");
  for (int64_t round = 0; round < 5; ++round) {
    auto ids = round_ids(round).to(gpu);
    EXPECT_TRUE(torch::equal(graphed.forward(ids), eager.forward(ids))) << "round " << round;
    EXPECT_TRUE(torch::equal(graphed.saved().at("head").back(), eager.saved().at("head").back()));
  }
  const auto& stats = graphed.graph_stats();
  std::cout << "[ info ] moe_tp1: captures " << stats.captures << ", replays " << stats.replays << ", refusals "
            << stats.refusals << "\n";
  EXPECT_EQ(stats.captures + stats.refusals, 1) << "the third forward captures or is refused, once";
  EXPECT_EQ(stats.replays, stats.captures == 1 ? 3 : 0);
}

}  // namespace
}  // namespace frag::program
