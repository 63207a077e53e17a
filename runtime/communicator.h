//===- runtime/communicator.h - Collectives over one group -------*- C++ -*-===//
//
// A Communicator runs collectives among the ranks of one group. The model's own
// ops (frag::all_reduce, frag::all_gather) and the fragment runtime's gathers
// both go through it. Backends: Gloo for CPU tensors, NCCL for CUDA tensors,
// and a single-rank communicator for world size 1. Every collective has a
// timeout: a rank that dies makes the others fail, never wait forever.
//
// Collectives may return before they ran (NCCL enqueues them on the current
// CUDA stream; a watchdog enforces the timeout): synchronize() waits for what
// was enqueued and throws what failed. The forward calls it once at its end.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <c10/util/intrusive_ptr.h>
#include <torch/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class Store;
}

namespace frag::runtime {

/// Collectives among the ranks of one group.
class Communicator {
 public:
  virtual ~Communicator() = default;

  /// This process's index in the group.
  virtual int rank() const = 0;
  /// Number of ranks in the group.
  virtual int size() const = 0;
  /// "gloo", "nccl" or "single".
  virtual std::string backend() const = 0;

  /// Sum over ranks, out of place. Every rank gets the same result.
  torch::Tensor all_reduce(const torch::Tensor& x);
  /// Every rank's tensor (all of one shape), in group-rank order.
  std::vector<torch::Tensor> all_gather(const torch::Tensor& x);
  /// Every rank's tensor stacked in one fresh buffer [size, *x.shape], in
  /// group-rank order (what fused assembly reads).
  torch::Tensor all_gather_stacked(const torch::Tensor& x);
  /// Waits until every collective enqueued so far has finished; throws the
  /// error of one that failed or timed out (on every later call too). A no-op
  /// for backends whose collectives finish before they return.
  virtual void synchronize() {}

  /// Whether a CUDA graph may capture this communicator's collectives: they are enqueued on the current
  /// stream and nothing waits on the host (runtime/cuda_graph.h). Single-rank and NCCL communicators.
  virtual bool capturable() const { return false; }
  /// After a replayed graph: watches everything enqueued on the current stream so far as if it were one
  /// collective (the replay's own ran unwatched), so synchronize() waits for it and the timeout holds.
  virtual void watch_replay() {}

  /// Collectives this communicator has run since it was made.
  int64_t collective_count() const { return collective_count_.load(); }

 protected:
  virtual torch::Tensor do_all_reduce(const torch::Tensor& x) = 0;
  virtual std::vector<torch::Tensor> do_all_gather(const torch::Tensor& x) = 0;
  /// Default: do_all_gather and a stack (one more copy).
  virtual torch::Tensor do_all_gather_stacked(const torch::Tensor& x) { return torch::stack(do_all_gather(x)); }

 private:
  std::atomic<int64_t> collective_count_{0};
};

/// World size 1: collectives are copies.
std::shared_ptr<Communicator> make_single_rank_communicator();

/// Gloo (CPU tensors) over a c10d store. Throws frag::Error where this build
/// has no Gloo (PyTorch's pip wheels ship no gloo headers).
std::shared_ptr<Communicator> make_gloo_communicator(
    const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& hostname);

/// NCCL (CUDA tensors) over a c10d store used to share the NCCL unique id.
/// Collectives are enqueued on the current stream and return; a watchdog
/// thread aborts the communicator when one makes no progress for `timeout` or
/// NCCL reports an error, and the next collective or synchronize() throws.
/// `sync_each_collective` (or FRAG_NCCL_SYNC_EACH=1 in the environment) waits
/// after every collective instead, as before (for benchmarks and debugging).
/// Throws frag::Error where this build has no NCCL.
std::shared_ptr<Communicator> make_nccl_communicator(
    const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix, int rank, int size,
    std::chrono::milliseconds timeout, int cuda_device, bool sync_each_collective = false);

/// The collectives of torch.distributed's process group `group_name` (registered by Python in this
/// process: init_process_group's default group is "0"), on its own backend (Gloo for CPU tensors, NCCL
/// for CUDA ones); each waits at most `timeout`. frag::Error where no group has that name.
std::shared_ptr<Communicator> make_process_group_communicator(const std::string& group_name,
                                                              std::chrono::milliseconds timeout);

/// Whether this build can make each backend.
bool have_gloo();
bool have_nccl();

}  // namespace frag::runtime
