//===- runtime/nccl_communicator.cpp - GPU collectives over NCCL ---------===//
//
// Talks to NCCL directly (nccl.h), so it builds against any LibTorch, also
// Debian's CPU-only one: CI compiles it here, it runs on GPU machines. Rank 0
// makes the NCCL unique id and shares it through the c10d store. Collectives
// run on PyTorch's current CUDA stream where this build has c10_cuda
// (FRAG_WITH_C10_CUDA), else on the legacy default stream, which orders with
// PyTorch's default stream. A collective is enqueued and returns: no host
// synchronisation per collective. A CUDA event recorded behind each one goes to
// a CollectiveWatchdog, whose thread aborts the communicator when NCCL reports
// an error or no collective finishes for the timeout; the next collective or
// synchronize() (once per forward) throws its one-line error. So no rank
// waits forever, and the host runs ahead of the GPU as in plain PyTorch.
//
//===----------------------------------------------------------------------===//
#include "ir/error.h"
#include "runtime/collective_watchdog.h"
#include "runtime/communicator.h"
#include "runtime/cuda_graph.h"

#ifdef FRAG_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdlib>
#include <cstring>
#include <fmt/format.h>
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
                   int rank, int size, std::chrono::milliseconds timeout, int device, bool sync_each)
      : rank_(rank), size_(size), timeout_(timeout), device_(device), sync_each_(sync_each) {
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
    CollectiveWatchdog::Backend backend;
    backend.finished = [](CollectiveWatchdog::Marker marker) {
      // An error here (a broken context) counts as finished; the async error says why.
      return cudaEventQuery(static_cast<cudaEvent_t>(marker)) != cudaErrorNotReady;
    };
    backend.async_error = [this]() -> std::optional<std::string> {
      if (comm_ == nullptr) return std::nullopt;
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) return std::string("ncclCommGetAsyncError failed");
      if (state == ncclSuccess || state == ncclInProgress) return std::nullopt;
      return std::string(ncclGetErrorString(state));
    };
    backend.abort = [this] {
      if (comm_ != nullptr) ncclCommAbort(comm_);
      comm_ = nullptr;
    };
    backend.thread_start = [device = device_] { cudaSetDevice(device); };
    watchdog_ = std::make_unique<CollectiveWatchdog>(std::move(backend), timeout_,
                                                     fmt::format("NCCL rank {} of {}", rank_, size_));
  }

  ~NcclCommunicator() override {
    watchdog_.reset();  // stops its thread before the communicator goes
    if (comm_ != nullptr) ncclCommDestroy(comm_);
    for (auto event : events_) cudaEventDestroy(event);
  }

  void synchronize() override { watchdog_->wait_all(); }

#ifdef FRAG_WITH_C10_CUDA
  // On the current stream, with no host wait: a CUDA graph may hold them (not in sync-each mode).
  bool capturable() const override { return !sync_each_; }
#endif

  void watch_replay() override { watch_stream("a replayed CUDA graph's collectives"); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }

 protected:
  torch::Tensor do_all_reduce(const torch::Tensor& x) override {
    check_device(x);
    auto input = x.contiguous();
    auto output = torch::empty_like(input);
    enqueue("all_reduce", [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclAllReduce(input.data_ptr(), output.data_ptr(), input.numel(), nccl_type(input.scalar_type()),
                           ncclSum, comm, stream);
    });
    return output;
  }

  std::vector<torch::Tensor> do_all_gather(const torch::Tensor& x) override {
    return do_all_gather_stacked(x).unbind(0);
  }

  torch::Tensor do_all_gather_stacked(const torch::Tensor& x) override {
    check_device(x);
    auto input = x.contiguous();
    std::vector<int64_t> shape{size_};
    for (auto d : input.sizes()) shape.push_back(d);
    auto output = torch::empty(shape, input.options());
    enqueue("all_gather", [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclAllGather(input.data_ptr(), output.data_ptr(), input.numel(), nccl_type(input.scalar_type()), comm,
                           stream);
    });
    return output;
  }

 private:
  cudaStream_t stream() const {
#ifdef FRAG_WITH_C10_CUDA
    return c10::cuda::getCurrentCUDAStream(device_).stream();
#else
    return cudaStreamLegacy;
#endif
  }

  /// Enqueues one collective on the current stream and returns: the inputs
  /// and outputs are tensors of PyTorch's caching allocator, whose blocks are
  /// reused only in this stream's order, so they need no host wait either.
  template <typename Call>
  void enqueue(const char* what, Call call) {
    watchdog_->check();
    const cudaStream_t s = stream();
    {
      std::lock_guard<std::mutex> lock(watchdog_->backend_mutex());
      if (comm_ == nullptr) fail("NCCL {} on rank {} of {}: the communicator was aborted", what, rank_, size_);
      const ncclResult_t status = call(comm_, s);
      check_nccl(status, what);
      // A non-blocking communicator may still be setting up (first use of a
      // peer): its enqueue completes before the next call may start.
      if (status == ncclInProgress) wait_for_comm(what);
    }
    // A collective captured in a CUDA graph has not run: its replay is watched instead (watch_replay).
    if (CudaGraph::capturing()) return;
    watch_stream(what);
    if (sync_each_) synchronize();
  }

  /// A marker behind what the current stream holds so far, for the watchdog.
  void watch_stream(const char* what) {
    cudaEvent_t event = next_event();
    check_cuda(cudaEventRecord(event, stream()), "cudaEventRecord");
    watchdog_->watch(event, what);
  }

  cudaEvent_t next_event() {
    for (auto marker : watchdog_->take_finished()) free_events_.push_back(static_cast<cudaEvent_t>(marker));
    if (!free_events_.empty()) {
      cudaEvent_t event = free_events_.back();
      free_events_.pop_back();
      return event;
    }
    cudaEvent_t event = nullptr;
    check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    events_.push_back(event);
    return event;
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
  bool sync_each_;
  ncclComm_t comm_ = nullptr;
  std::vector<cudaEvent_t> events_;       ///< every event made, destroyed with the communicator
  std::vector<cudaEvent_t> free_events_;  ///< finished ones, to record again
  std::unique_ptr<CollectiveWatchdog> watchdog_;
};

}  // namespace

bool have_nccl() { return true; }

std::shared_ptr<Communicator> make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const std::string& prefix, int rank, int size,
                                                     std::chrono::milliseconds timeout,
                                                     int cuda_device, bool sync_each_collective) {
  const char* env = std::getenv("FRAG_NCCL_SYNC_EACH");
  if (env != nullptr && std::string(env) == "1") sync_each_collective = true;
  return std::make_shared<NcclCommunicator>(store, prefix, rank, size, timeout, cuda_device, sync_each_collective);
}

#else

bool have_nccl() { return false; }

std::shared_ptr<Communicator> make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>&,
                                                     const std::string&, int, int,
                                                     std::chrono::milliseconds, int, bool) {
  fail("this build of fragments has no NCCL backend (configure with NCCL found to enable it)");
}

#endif

}  // namespace frag::runtime
