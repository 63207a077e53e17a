//===- runtime/row_gather_cuda.cu - Rows of several tensors, one launch --===//
//
// gather_rows' fused form: one kernel for every tensor's rows, each row copied
// as the widest word (16, 8, 4, 2 or 1 bytes) that every address and stride
// allows. Built by CMake where a CUDA compiler and a CUDA LibTorch are found
// (FRAG_WITH_CUDA_KERNELS); it registers itself with row_gather.cpp, which
// checks the arguments first. Tensors past kMaxParts go in further launches.
//
//===----------------------------------------------------------------------===//
#include "runtime/row_gather.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

namespace frag::runtime {
namespace {

constexpr int kMaxParts = 32;  // 32 parts of 48 bytes: well inside a kernel's 4 KiB of parameters
constexpr int kThreads = 256;

struct Part {
  const char* src;
  char* dst;
  const int64_t* index;
  int64_t src_stride;  // bytes from one source row to the next
  int64_t row_bytes;
  int64_t count;
};

struct Parts {
  Part part[kMaxParts];
};

template <typename Word>
__global__ void gather_rows_kernel(Parts parts) {
  const Part& p = parts.part[blockIdx.y];
  const int64_t words = p.row_bytes / static_cast<int64_t>(sizeof(Word));
  for (int64_t row = blockIdx.x; row < p.count; row += gridDim.x) {
    const Word* from = reinterpret_cast<const Word*>(p.src + p.index[row] * p.src_stride);
    Word* to = reinterpret_cast<Word*>(p.dst + row * p.row_bytes);
    for (int64_t i = threadIdx.x; i < words; i += blockDim.x) to[i] = from[i];
  }
}

// The widest word that divides every address, stride and row size of the launch.
int64_t word_bytes(const Parts& parts, int n) {
  uint64_t bits = 16;
  for (int i = 0; i < n; ++i) {
    const Part& p = parts.part[i];
    bits |= reinterpret_cast<uintptr_t>(p.src) | reinterpret_cast<uintptr_t>(p.dst) |
            static_cast<uint64_t>(p.src_stride) | static_cast<uint64_t>(p.row_bytes);
  }
  return static_cast<int64_t>(bits & (~bits + 1));  // the lowest set bit: at most 16
}

void launch(const Parts& parts, int n, int64_t rows, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(rows, 1), 65535)),
                  static_cast<unsigned>(n));
  switch (word_bytes(parts, n)) {
    case 16: gather_rows_kernel<uint4><<<grid, kThreads, 0, stream>>>(parts); break;
    case 8: gather_rows_kernel<uint2><<<grid, kThreads, 0, stream>>>(parts); break;
    case 4: gather_rows_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(parts); break;
    case 2: gather_rows_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(parts); break;
    default: gather_rows_kernel<uint8_t><<<grid, kThreads, 0, stream>>>(parts); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void gather_rows_cuda(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& indices,
                      const std::vector<at::Tensor>& outs) {
  const c10::cuda::CUDAGuard guard(srcs[0].device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  Parts parts{};
  int n = 0;
  int64_t rows = 0;
  for (size_t i = 0; i < srcs.size(); ++i) {
    const at::Tensor& src = srcs[i];
    const int64_t count = indices[i].size(0);
    const int64_t row_bytes = src.numel() == 0 ? 0 : src.numel() / src.size(0) * src.element_size();
    if (count == 0 || row_bytes == 0) continue;
    parts.part[n++] = Part{static_cast<const char*>(src.const_data_ptr()),
                           static_cast<char*>(outs[i].mutable_data_ptr()), indices[i].const_data_ptr<int64_t>(),
                           src.stride(0) * src.element_size(), row_bytes, count};
    rows = std::max(rows, count);
    if (n == kMaxParts) {
      launch(parts, n, rows, stream);
      n = 0;
      rows = 0;
    }
  }
  if (n > 0) launch(parts, n, rows, stream);
}

const bool registered = detail::set_fused_gather(&gather_rows_cuda);

}  // namespace
}  // namespace frag::runtime
