//===- program/captured_forwards.h - Forwards replayed from CUDA graphs -*- C++ -*-===//
//
// On a GPU most of a forward's time is the host's: the interpreter dispatches
// node by node and every op launches its kernels one by one. With a fixed plan
// and input shape the launches are the same every time, so ShardedModel
// captures the (plan-specialized) forward once in a CUDA graph
// (runtime/cuda_graph.h), collectives included, and replays it:
//   - a shape runs eagerly kEagerRunsFirst times (the profiling executor builds
//     its optimized plan on the second run, and lazy state — cuBLAS workspaces,
//     the assembly's index plans, edit values moved to the device — is made),
//     is captured on the next, and replayed from then on;
//   - what the plan saves during the capture are buffers of the graph: a
//     replay refills them and the model hands out copies, as it hands out a
//     copy of the logits buffer (both outlive the next forward);
//   - kCapacity (plan, shape) entries are kept, least recently used goes: a
//     plan registered again (a Python trace per forward) finds its graph; a
//     change of the weights' storage drops them all.
// Forwards that must call back stay eager: hooks registered with on() (C++ or
// Python callables), communicators that wait on the host (torch.distributed
// groups, Gloo, FRAG_NCCL_SYNC_EACH), and shapes whose capture CUDA refused (a
// model that reads tensor values to branch, such as MoE routing that skips
// empty experts): those run as before. Plan steps that call modules (a logit
// lens) only enqueue work and are captured with the forward.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "runtime/cuda_graph.h"
#include "runtime/intervention_runtime.h"

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace frag::program {

class CapturedForwards {
 public:
  static constexpr size_t kCapacity = 4;
  static constexpr int64_t kEagerRunsFirst = 2;

  /// One plan's forward of one input shape.
  struct Entry {
    std::string plan;  ///< the interventions' canonical text (ShardedModel's descriptors), registration order
    bool specialize = true;
    std::vector<int64_t> shape;
    at::ScalarType dtype = at::kLong;
    int64_t eager_runs = 0;
    std::optional<std::string> refused;  ///< why CUDA would not capture it: it runs eagerly
    std::unique_ptr<runtime::CudaGraph> graph;
    torch::Tensor input;   ///< the graph's input buffer: a replay reads the ids copied here
    torch::Tensor output;  ///< the logits buffer a replay fills
    torch::Tensor positions;  ///< a decode step's positions buffer (program/decoder.h); undefined for a forward
    /// (name, buffer) of every save the plan made during the capture, in order; a replay refills them.
    std::vector<std::pair<std::string, torch::Tensor>> saves;
    /// Tensors the graph reads that the plan's hooks own (edit values on the device): a plan registered
    /// again later is replayed from here while the hooks that made them are gone.
    std::vector<torch::Tensor> held;
    runtime::InterventionRuntime::Counts counts;  ///< what the captured forward did at each location
    bool captured() const { return graph != nullptr; }
  };

  /// Counts since the model was loaded, for tests and benchmarks.
  struct Stats {
    int64_t captures = 0;
    int64_t replays = 0;
    int64_t refusals = 0;
  };

  /// The entry of (plan, specialize, input shape): cached (made the most recent), or new (the least
  /// recently used goes when full). `weights` is the storage of the model's first weight: a graph reads
  /// the weights where they were, so another value than the last drops every entry first.
  Entry& entry(const std::string& plan, bool specialize, const void* weights, const torch::Tensor& input);
  /// Drops every entry (their graphs and buffers).
  void clear() { entries_.clear(); }

  Stats& stats() { return stats_; }
  const Stats& stats() const { return stats_; }

 private:
  const void* weights_ = nullptr;
  std::vector<std::unique_ptr<Entry>> entries_;  ///< most recently used last
  Stats stats_;
};

}  // namespace frag::program
