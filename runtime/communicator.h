//===- runtime/communicator.h - Collectives over one group -------*- C++ -*-===//
//
// A Communicator runs collectives among the ranks of one group. The model's own
// ops (frag::all_reduce, frag::all_gather) and the fragment runtime's gathers
// both go through it. Backends: Gloo for CPU tensors, NCCL for CUDA tensors,
// and a single-rank communicator for world size 1. Every collective has a
// timeout: a rank that dies makes the others fail, never wait forever.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <c10/util/intrusive_ptr.h>
#include <torch/torch.h>

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

  /// Collectives this communicator has run since it was made.
  int64_t collective_count() const { return collective_count_.load(); }

 protected:
  virtual torch::Tensor do_all_reduce(const torch::Tensor& x) = 0;
  virtual std::vector<torch::Tensor> do_all_gather(const torch::Tensor& x) = 0;

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
/// Throws frag::Error where this build has no NCCL.
std::shared_ptr<Communicator> make_nccl_communicator(
    const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix, int rank, int size,
    std::chrono::milliseconds timeout, int cuda_device);

/// Whether this build can make each backend.
bool have_gloo();
bool have_nccl();

}  // namespace frag::runtime
