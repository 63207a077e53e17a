//===- runtime/device_memory.h - Memory free on a device -------------*- C++ -*-===//
//
// What a large allocation (a KV cache) checks before it is made, so that a
// request past the device is refused in one line instead of by the
// allocator's own words after the attempt.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace frag::runtime {

/// Bytes a new tensor could take on `device`; -1 where unknown. CPU: MemAvailable of /proc/meminfo.
/// CUDA (builds with FRAG_WITH_C10_CUDA): the device's free memory (cudaMemGetInfo) plus what PyTorch's
/// caching allocator holds reserved but unallocated there; elsewhere unknown.
int64_t free_memory(const c10::Device& device);

}  // namespace frag::runtime
