//===- runtime/layer_ops.h - The kit's layer math as ops -------*- C++ -*-===//
//
// frag::rms_norm, frag::rotary_embedding and frag::silu_and_mul (schemas in
// ir/op_schemas.h). The kit's layers (fragkit/models.py) call them, so the
// exported graph and the rewritten one run the same kernels: with fused CUDA
// kernels (layer_ops_cuda.cu) reads stay bit-identical whatever fragment ops
// sit between them. These are the reference forms, op by op in the order the
// kit's Python wrote them before (and fragkit/ops.py still does): on the CPU,
// a file exported with the ops computes the same bits as one exported before.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace frag::runtime {

at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps);

std::tuple<at::Tensor, at::Tensor> rotary_embedding_reference(const at::Tensor& positions,
                                                              const at::Tensor& query, const at::Tensor& key,
                                                              const at::Tensor& cos_sin_cache, int64_t head_size,
                                                              int64_t rotary_dim, bool is_neox);

at::Tensor silu_and_mul_reference(const at::Tensor& x);

}  // namespace frag::runtime
