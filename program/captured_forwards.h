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

#include "program/saved_values.h"
#include "runtime/cuda_graph.h"
#include "runtime/intervention_runtime.h"
#include "runtime/rank_context.h"

#include <torch/types.h>

#include <cstdint>
#include <functional>
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

  /// What a graph is of, besides its input's shape and dtype: numbers made when the plan changes, no text.
  struct Key {
    uint64_t plan = 0;  ///< RankAgreement::plan_digest: the hooks registered, in order
    bool specialize = true;
    /// A decode step (program/decoder.h) reads and writes its cache where it is: the graph is that cache's
    /// (its storage, its rows) and that attended length's.
    bool decode = false;
    const void* cache = nullptr;
    int64_t cache_rows = 0;
    int64_t cache_len = 0;
    /// A padded bucket's real rows where a plan is registered (its steps and saves act on those rows, a
    /// narrowing the graph holds); 0 otherwise, so without a plan one graph serves every batch of a bucket.
    int64_t real_rows = 0;
    bool operator==(const Key& other) const {
      return plan == other.plan && specialize == other.specialize && decode == other.decode &&
             cache == other.cache && cache_rows == other.cache_rows && cache_len == other.cache_len &&
             real_rows == other.real_rows;
    }
  };

  /// One plan's forward of one input shape.
  struct Entry {
    Key key;
    std::vector<int64_t> shape;
    at::ScalarType dtype = at::kLong;
    int64_t eager_runs = 0;
    std::optional<std::string> refused;  ///< why CUDA would not capture it: it runs eagerly
    std::unique_ptr<runtime::CudaGraph> graph;
    torch::Tensor input;   ///< the graph's input buffer: a replay reads the ids copied here
    torch::Tensor output;  ///< the logits buffer a replay fills
    torch::Tensor positions;  ///< a decode step's positions buffer (program/decoder.h); undefined for a forward
    /// (slot, buffer) of every save the plan made during the capture, in order; a replay refills them.
    std::vector<std::pair<SavedValues::Slot, torch::Tensor>> saves;
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

  /// What a capture and a replay touch besides the entry.
  struct Forward {
    /// Runs the (specialized) forward of `ids` (at `positions`: a decode step; else undefined).
    std::function<torch::Tensor(const torch::Tensor& ids, const torch::Tensor& positions)> run;
    runtime::InterventionRuntime& interventions;
    runtime::RankContext& context;
    SavedValues& saved;  ///< a capture's saves become the graph's buffers; a replay keeps copies here
    /// The tensors the hooks keep on the device (edit values): the graph holds them.
    std::function<std::vector<torch::Tensor>()> hook_values;
    const std::string& path;  ///< the rank file, for messages
  };

  /// The entry of (key, input shape and dtype): cached (made the most recent), or new (the least
  /// recently used goes when full). `weights` is the storage of the model's first weight: a graph reads
  /// the weights where they were, so another value than the last drops every entry first.
  Entry& entry(const Key& key, const void* weights, const torch::Tensor& input);
  /// Runs one forward of `entry`'s key and shape: eagerly for its first kEagerRunsFirst runs and where
  /// CUDA refused to capture it, captured on the next, replayed from then on. Returns the logits.
  torch::Tensor run(Entry& entry, const torch::Tensor& ids, const torch::Tensor& positions, const Forward& forward);
  /// Drops every entry (their graphs and buffers).
  void clear() { entries_.clear(); }

  Stats& stats() { return stats_; }
  const Stats& stats() const { return stats_; }

 private:
  /// Captures the forward into `entry`; where CUDA refuses, marks it refused (it runs eagerly from then on).
  void capture(Entry& entry, const torch::Tensor& ids, const torch::Tensor& positions, const Forward& forward);
  torch::Tensor replay(Entry& entry, const torch::Tensor& ids, const torch::Tensor& positions, const Forward& forward);

  const void* weights_ = nullptr;
  std::vector<std::unique_ptr<Entry>> entries_;  ///< most recently used last
  Stats stats_;
};

}  // namespace frag::program
