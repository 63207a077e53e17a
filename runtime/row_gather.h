//===- runtime/row_gather.h - Rows of several tensors, one launch -*- C++ -*-===//
//
// gather_rows(srcs, indices, outs): outs[i] = srcs[i][indices[i]] for every i,
// the rows of several tapped values gathered after a CUDA graph's replay (the
// vLLM worker's drain, python/fragments/vllm/_drain.py). On a GPU with the
// fused kernel built (row_gather_cuda.cu, CMake's FRAG_WITH_CUDA_KERNELS) it
// is one kernel launch for all of them: the worker's step waits on the host
// (run37), where each index_select is a launch and a Python call. Elsewhere
// (the CPU, a build without nvcc) one index_select per tensor.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace frag::runtime {

// srcs[i]: [rows, ...] with its rows strided and each row dense; indices[i]:
// int64 [n_i] on srcs[i]'s device, every value in [0, rows) (the caller's
// check: the device kernel does not look); outs[i]: dense [n_i, ...], srcs[i]'s
// dtype and device. Anything else: frag::Error naming the tensor.
void gather_rows(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& indices,
                 const std::vector<at::Tensor>& outs);

// Whether gather_rows on a CUDA device is one launch (the fused kernel was built).
bool gather_rows_fused();

namespace detail {
// Set by row_gather_cuda.cu's static initializer; null without it.
using FusedGather = void (*)(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                             const std::vector<at::Tensor>&);
bool set_fused_gather(FusedGather fused);
}  // namespace detail

}  // namespace frag::runtime
