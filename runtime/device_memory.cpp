//===- runtime/device_memory.cpp - Memory free on a device ----------------===//
#include "runtime/device_memory.h"

#ifdef FRAG_WITH_C10_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#endif

#include <fstream>
#include <sstream>
#include <string>

namespace frag::runtime {
namespace {

/// MemAvailable of /proc/meminfo in bytes; -1 where unknown.
int64_t available_host_memory() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    int64_t kib = -1;
    fields >> kib;
    return kib < 0 ? -1 : kib * 1024;
  }
  return -1;
}

#ifdef FRAG_WITH_C10_CUDA
int64_t free_cuda_memory(const c10::Device& device) {
  const auto index = device.has_index() ? device.index() : c10::cuda::current_device();
  c10::cuda::CUDAGuard on_device(index);
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: the allocation after reports what is wrong in its own words
    return -1;
  }
  // Blocks PyTorch's allocator keeps reserved but holds no tensor in are free to the next allocation too.
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  const int64_t cached = stats.reserved_bytes[kAll].current - stats.allocated_bytes[kAll].current;
  return static_cast<int64_t>(free) + (cached > 0 ? cached : 0);
}
#endif

}  // namespace

int64_t free_memory(const c10::Device& device) {
  if (device.is_cpu()) return available_host_memory();
#ifdef FRAG_WITH_C10_CUDA
  if (device.is_cuda()) return free_cuda_memory(device);
#endif
  return -1;
}

}  // namespace frag::runtime
