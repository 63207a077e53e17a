//===- runtime/cuda_graph.h - One captured CUDA graph -------------*- C++ -*-===//
//
// A forward on a GPU with a fixed plan and input shape enqueues the same
// kernels and collectives every time; the host's part (the TorchScript
// interpreter dispatching node by node, the hooks) is most of its time. A
// CudaGraph records what a piece of work enqueues once and replays it with one
// launch. What the work allocates comes from the graph's own memory pool and
// stays put, so tensors made during the capture are buffers every replay
// refills (program/captured_forwards.h keeps them).
//
// The capture runs on a side stream in thread-local mode: the watchdog and
// NCCL's threads keep calling CUDA meanwhile. Work that needs the host during
// the capture (a tensor's value read back, a pageable copy) makes CUDA
// refuse it; the capture is then abandoned cleanly and the error rethrown, so
// the caller can run that work eagerly instead.
//
// Built where LibTorch has CUDA (FRAG_WITH_C10_CUDA: the CMake build against the
// pinned CUDA wheel); elsewhere available() is false and constructing one fails.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <functional>
#include <memory>

namespace frag::runtime {

class CudaGraph {
 public:
  /// Whether this build can capture CUDA graphs.
  static bool available();
  /// True on the thread that is capturing one: code that would wait for the GPU (a forward's
  /// synchronize, a collective's watchdog marker) must not, as the work has not run.
  static bool capturing();

  /// Captures what `work` enqueues on the current CUDA device (on a side stream that first waits for
  /// the current one). Throws frag::Error, the graph abandoned, where the work fails or CUDA refuses it.
  explicit CudaGraph(const std::function<void()>& work);
  ~CudaGraph();
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  /// Enqueues the captured work on the current stream.
  void replay();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace frag::runtime
