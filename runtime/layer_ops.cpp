//===- runtime/layer_ops.cpp - The kit's layer math, reference kernels ----===//
//
// Registered as CompositeExplicitAutograd: the CPU runs these, and so does a
// GPU build without layer_ops_cuda.cu (whose CUDA registrations take
// precedence where they exist). Each mirrors fragkit/models.py's former
// Python op for op, so CPU results keep their bits.
//
//===----------------------------------------------------------------------===//
#include "runtime/layer_ops.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

namespace frag::runtime {
namespace {

/// One of query/key: [..., n * head_size] rotated per head, in float32, back to x's dtype.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t head_size,
                  int64_t rotary_dim, bool is_neox) {
  std::vector<int64_t> heads(x.sizes().begin(), x.sizes().end() - 1);
  heads.push_back(-1);
  heads.push_back(head_size);
  auto h = x.reshape(heads).to(at::kFloat);
  auto rot = h.narrow(-1, 0, rotary_dim);
  auto rest = h.narrow(-1, rotary_dim, head_size - rotary_dim);
  auto c = cos.unsqueeze(-2);
  auto s = sin.unsqueeze(-2);
  if (is_neox) {
    const int64_t half = rotary_dim / 2;
    auto x1 = rot.narrow(-1, 0, half);
    auto x2 = rot.narrow(-1, half, half);
    rot = at::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
  } else {
    auto x1 = rot.slice(-1, 0, rotary_dim, 2);
    auto x2 = rot.slice(-1, 1, rotary_dim, 2);
    rot = at::stack({x1 * c - x2 * s, x2 * c + x1 * s}, -1).flatten(-2);
  }
  return at::cat({rot, rest}, -1).to(x.scalar_type()).reshape(x.sizes());
}

}  // namespace

at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto h = x.to(at::kFloat);
  auto variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps);
  return h.to(x.scalar_type()) * weight;
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding_reference(const at::Tensor& positions,
                                                              const at::Tensor& query, const at::Tensor& key,
                                                              const at::Tensor& cos_sin_cache, int64_t head_size,
                                                              int64_t rotary_dim, bool is_neox) {
  auto cos_sin = cos_sin_cache.index_select(0, positions.reshape(-1));
  if (positions.dim() > 1)
    cos_sin = cos_sin.reshape({positions.size(0), positions.size(1), -1});
  const int64_t half = rotary_dim / 2;
  auto cos = cos_sin.narrow(-1, 0, half);
  auto sin = cos_sin.narrow(-1, half, half);
  return {rotate(query, cos, sin, head_size, rotary_dim, is_neox),
          rotate(key, cos, sin, head_size, rotary_dim, is_neox)};
}

at::Tensor silu_and_mul_reference(const at::Tensor& x) {
  const int64_t d = x.size(-1) / 2;
  return at::silu(x.narrow(-1, 0, d)) * x.narrow(-1, d, d);
}

TORCH_LIBRARY_IMPL(frag, CompositeExplicitAutograd, m) {
  m.impl("rms_norm", &rms_norm_reference);
  m.impl("rotary_embedding", &rotary_embedding_reference);
  m.impl("silu_and_mul", &silu_and_mul_reference);
}

}  // namespace frag::runtime
