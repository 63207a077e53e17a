//===- runtime/cuda_graph.cpp - One captured CUDA graph -------------------===//
#include "runtime/cuda_graph.h"

#include "ir/error.h"

#ifdef FRAG_WITH_C10_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

namespace frag::runtime {
namespace {
thread_local bool capturing_here = false;

/// Marks this thread as capturing while it lives.
class CapturingScope {
 public:
  CapturingScope() { capturing_here = true; }
  ~CapturingScope() { capturing_here = false; }
  CapturingScope(const CapturingScope&) = delete;
  CapturingScope& operator=(const CapturingScope&) = delete;
};
}  // namespace

bool CudaGraph::capturing() { return capturing_here; }

#ifdef FRAG_WITH_C10_CUDA

struct CudaGraph::Impl {
  at::cuda::CUDAGraph graph;
};

bool CudaGraph::available() { return true; }

CudaGraph::CudaGraph(const std::function<void()>& work) : impl_(std::make_unique<Impl>()) {
  const auto current = c10::cuda::getCurrentCUDAStream();
  // CUDA cannot capture the legacy default stream: capture on a side stream that sees what came before.
  auto side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, current.device_index());
  cudaEvent_t ready = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(ready, current.stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(side.stream(), ready, 0));
  C10_CUDA_CHECK(cudaEventDestroy(ready));
  c10::cuda::CUDAStreamGuard on_side(side);
  enum class Stage { kBefore, kCapturing, kEnding } stage = Stage::kBefore;
  const auto pool = at::cuda::graph_pool_handle();  // ours: CUDAGraph::pool() answers only after a capture
  try {
    CapturingScope scope;
    impl_->graph.capture_begin(pool, cudaStreamCaptureModeThreadLocal);
    stage = Stage::kCapturing;
    work();
    stage = Stage::kEnding;
    impl_->graph.capture_end();
  } catch (const std::exception& e) {
    const std::string why = e.what();
    if (stage == Stage::kCapturing) {  // the work failed: end the capture it left open
      cudaGraph_t abandoned = nullptr;
      cudaStreamEndCapture(side.stream(), &abandoned);
      if (abandoned != nullptr) cudaGraphDestroy(abandoned);
    }
    if (stage != Stage::kBefore) {
      // capture_end throws before it lets the allocator leave the graph's pool, and a graph whose capture
      // never ended does not give the pool back: both here, so a refused capture leaks nothing. (Where
      // capture_end got past the allocator, the graph holds its capture and gives the pool back itself.)
      const auto device = side.device_index();
      bool left_pool = false;
      try {
        c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
        left_pool = true;
      } catch (const std::exception&) {
      }
      if (left_pool) {
        try {
          c10::cuda::CUDACachingAllocator::releasePool(device, pool);
        } catch (const std::exception&) {
        }
      }
    }
    cudaGetLastError();  // a call refused during a capture leaves a (non-sticky) error behind
    const auto newline = why.find('\n');
    fail("CUDA graph capture failed: {}", newline == std::string::npos ? why : why.substr(0, newline));
  }
}

CudaGraph::~CudaGraph() = default;

void CudaGraph::replay() { impl_->graph.replay(); }

#else

struct CudaGraph::Impl {};

bool CudaGraph::available() { return false; }

CudaGraph::CudaGraph(const std::function<void()>&) {
  fail("this build of fragments cannot capture CUDA graphs (it needs a LibTorch with CUDA: the CMake build "
       "finds c10_cuda there)");
}

CudaGraph::~CudaGraph() = default;

void CudaGraph::replay() {}

#endif

}  // namespace frag::runtime
