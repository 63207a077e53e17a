//===- runtime/nccl_communicator.cpp - GPU collectives over NCCL ---------===//
//
// Talks to NCCL directly (nccl.h), so it builds against any LibTorch, also
// Debian's CPU-only one: CI compiles it here, it runs on GPU machines. Rank 0
// makes the NCCL unique id and shares it through the c10d store. Collectives
// run on PyTorch's current CUDA stream where this build has c10_cuda
// (FRAG_WITH_C10_CUDA), else on the legacy default stream, which orders with
// PyTorch's default stream. Each collective is polled against the timeout and
// the communicator is aborted when it runs out, so no rank waits forever.
//
//===----------------------------------------------------------------------===//
#include "ir/error.h"
#include "runtime/communicator.h"

#ifdef FRAG_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstring>
#include <thread>

#ifdef FRAG_WITH_C10_CUDA
#include <c10/cuda/CUDAStream.h>
#endif
#endif

namespace frag::runtime {

#ifdef FRAG_WITH_NCCL
namespace {

ncclDataType_t nccl_type(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kChar: return ncclInt8;
    case at::kByte: return ncclUint8;
    default: fail("NCCL cannot reduce tensors of dtype {}", c10::toString(type));
  }
}

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) fail("CUDA error in {}: {}", what, cudaGetErrorString(status));
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix,
                   int rank, int size, std::chrono::milliseconds timeout, int device)
      : rank_(rank), size_(size), timeout_(timeout), device_(device) {
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    ncclUniqueId id;
    const std::string key = prefix + "/nccl_unique_id";
    if (rank == 0) {
      check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
      store->set(key, std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id),
                                           reinterpret_cast<uint8_t*>(&id) + sizeof(id)));
    } else {
      store->wait({key}, timeout);
      auto bytes = store->get(key);
      if (bytes.size() != sizeof(id)) fail("NCCL unique id of group '{}' has a wrong size", prefix);
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    // Non-blocking init, so the deadline also covers a peer that never arrives.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    check_nccl(ncclCommInitRankConfig(&comm_, size, id, rank, &config), "ncclCommInitRankConfig");
    wait_for_comm("ncclCommInitRank");
  }

  ~NcclCommunicator() override {
    if (comm_ != nullptr) ncclCommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }

 protected:
  torch::Tensor do_all_reduce(const torch::Tensor& x) override {
    check_device(x);
    auto input = x.contiguous();
    auto output = torch::empty_like(input);
    check_nccl(ncclAllReduce(input.data_ptr(), output.data_ptr(), input.numel(),
                             nccl_type(input.scalar_type()), ncclSum, comm_, stream()),
               "ncclAllReduce");
    wait_for_comm("ncclAllReduce");
    wait_for_stream("all_reduce");
    return output;
  }

  std::vector<torch::Tensor> do_all_gather(const torch::Tensor& x) override {
    check_device(x);
    auto input = x.contiguous();
    std::vector<int64_t> shape{size_};
    for (auto d : input.sizes()) shape.push_back(d);
    auto output = torch::empty(shape, input.options());
    check_nccl(ncclAllGather(input.data_ptr(), output.data_ptr(), input.numel(),
                             nccl_type(input.scalar_type()), comm_, stream()),
               "ncclAllGather");
    wait_for_comm("ncclAllGather");
    wait_for_stream("all_gather");
    return output.unbind(0);
  }

 private:
  cudaStream_t stream() const {
#ifdef FRAG_WITH_C10_CUDA
    return c10::cuda::getCurrentCUDAStream(device_).stream();
#else
    return cudaStreamLegacy;
#endif
  }

  void check_device(const torch::Tensor& x) const {
    if (!x.is_cuda()) fail("the NCCL backend needs CUDA tensors; got a {} tensor", x.device().str());
  }

  void check_nccl(ncclResult_t status, const char* what) {
    if (status != ncclSuccess && status != ncclInProgress)
      fail("NCCL error in {} on rank {} of {}: {}", what, rank_, size_, ncclGetErrorString(status));
  }

  void wait_for_comm(const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    ncclResult_t state = ncclInProgress;
    // A collective's enqueue finishes within microseconds: spin first (a 1 ms
    // sleep here cost every collective a millisecond), then back off to
    // sleeps for the long waits of a communicator's init.
    for (int polls = 0; state == ncclInProgress; ++polls) {
      check_nccl(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError");
      if (state != ncclInProgress) break;
      if (std::chrono::steady_clock::now() > deadline) abort(what);
      if (polls < 10000) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    check_nccl(state, what);
  }

  void wait_for_stream(const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (true) {
      cudaError_t status = cudaStreamQuery(stream());
      if (status == cudaSuccess) return;
      if (status != cudaErrorNotReady) check_cuda(status, what);
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) check_nccl(async, what);
      if (std::chrono::steady_clock::now() > deadline) abort(what);
      std::this_thread::yield();
    }
  }

  [[noreturn]] void abort(const char* what) {
    ncclCommAbort(comm_);
    comm_ = nullptr;
    fail("NCCL {} timed out after {} ms on rank {} of {} (a peer died or never arrived)", what,
         timeout_.count(), rank_, size_);
  }

  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  int device_;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

bool have_nccl() { return true; }

std::shared_ptr<Communicator> make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const std::string& prefix, int rank, int size,
                                                     std::chrono::milliseconds timeout,
                                                     int cuda_device) {
  return std::make_shared<NcclCommunicator>(store, prefix, rank, size, timeout, cuda_device);
}

#else

bool have_nccl() { return false; }

std::shared_ptr<Communicator> make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>&,
                                                     const std::string&, int, int,
                                                     std::chrono::milliseconds, int) {
  fail("this build of fragments has no NCCL backend (configure with NCCL found to enable it)");
}

#endif

}  // namespace frag::runtime
