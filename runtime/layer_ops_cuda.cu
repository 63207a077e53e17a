//===- runtime/layer_ops_cuda.cu - The kit's layer math, fused CUDA kernels ===//
//
// One kernel per op where the reference (layer_ops.cpp) launches 8 (RMSNorm),
// about 20 (rotary on q and k) or 2 (SiLU·mul). Built by CMake where a CUDA
// compiler and a CUDA LibTorch are found (FRAG_WITH_CUDA_KERNELS). Their
// registrations for the CUDA key take precedence over the reference's
// CompositeExplicitAutograd ones; shapes or dtypes they do not cover fall back
// to the reference.
//
// Rounding follows the reference: float32 arithmetic, each product and sum
// rounded on its own (__fmul_rn/__fadd_rn: no contraction into FMAs), values
// rounded to the tensor's dtype where the reference converts. Rotary and
// SiLU·mul then give the reference's bits; RMSNorm differs only by its
// reduction order. Reads stay bit-identical because the exported graph and
// its rewrite both call these same kernels.
//
//===----------------------------------------------------------------------===//
#include "runtime/layer_ops.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>

#include <algorithm>

namespace frag::runtime {
namespace {

constexpr int kNormThreads = 256;

template <typename T>
__global__ void rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ out,
                                int64_t width, float eps) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * width;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    const float v = static_cast<float>(xr[i]);
    sum = __fadd_rn(sum, __fmul_rn(v, v));
  }
  using Reduce = cub::BlockReduce<float, kNormThreads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ float scale;
  const float total = Reduce(storage).Sum(sum);
  if (threadIdx.x == 0)
    scale = rsqrtf(__fadd_rn(__fdiv_rn(total, static_cast<float>(width)), eps));
  __syncthreads();
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    const T normed = static_cast<T>(__fmul_rn(static_cast<float>(xr[i]), scale));
    out[row * width + i] = static_cast<T>(__fmul_rn(static_cast<float>(normed), static_cast<float>(weight[i])));
  }
}

template <typename T>
__global__ void silu_and_mul_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t d) {
  const int64_t row = blockIdx.y;
  const T* xr = x + row * 2 * d;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < d; i += gridDim.x * blockDim.x) {
    const float g = static_cast<float>(xr[i]);
    const T silu = static_cast<T>(__fdiv_rn(g, __fadd_rn(1.f, expf(-g))));
    out[row * d + i] = static_cast<T>(__fmul_rn(static_cast<float>(silu), static_cast<float>(xr[d + i])));
  }
}

/// One element of a rotated head: element `d` of the head starting at `head`.
template <typename T>
__device__ T rotated(const T* head, const float* cos, const float* sin, int d, int rotary_dim, bool is_neox) {
  const float v = static_cast<float>(head[d]);
  if (d >= rotary_dim)
    return head[d];
  const int half = rotary_dim / 2;
  if (is_neox) {
    if (d < half)  // x1 * c - x2 * s
      return static_cast<T>(
          __fsub_rn(__fmul_rn(v, cos[d]), __fmul_rn(static_cast<float>(head[d + half]), sin[d])));
    const int i = d - half;  // x2 * c + x1 * s
    return static_cast<T>(__fadd_rn(__fmul_rn(v, cos[i]), __fmul_rn(static_cast<float>(head[i]), sin[i])));
  }
  const int i = d / 2;
  if (d % 2 == 0)
    return static_cast<T>(
        __fsub_rn(__fmul_rn(v, cos[i]), __fmul_rn(static_cast<float>(head[d + 1]), sin[i])));
  return static_cast<T>(__fadd_rn(__fmul_rn(v, cos[i]), __fmul_rn(static_cast<float>(head[d - 1]), sin[i])));
}

struct RotaryShape {
  int64_t tokens;                      // T: a row is (b, t), blockIdx.x = b * T + t
  int64_t q_batch_stride, q_token_stride, k_batch_stride, k_token_stride;
  int64_t positions_batch_stride;      // 0 when positions is [T]
  int q_width, k_width, head_size, rotary_dim;
  int64_t max_positions;
};

template <typename T>
__global__ void rotary_kernel(const int64_t* __restrict__ positions, const T* __restrict__ query,
                              const T* __restrict__ key, const float* __restrict__ cos_sin, T* __restrict__ q_out,
                              T* __restrict__ k_out, RotaryShape s, bool is_neox) {
  const int64_t row = blockIdx.x;
  const int64_t b = row / s.tokens, t = row % s.tokens;
  const int64_t pos = positions[b * s.positions_batch_stride + t];
  CUDA_KERNEL_ASSERT(pos >= 0 && pos < s.max_positions);
  const float* cos = cos_sin + pos * s.rotary_dim;
  const float* sin = cos + s.rotary_dim / 2;
  const T* q = query + b * s.q_batch_stride + t * s.q_token_stride;
  const T* k = key + b * s.k_batch_stride + t * s.k_token_stride;
  for (int e = threadIdx.x; e < s.q_width + s.k_width; e += blockDim.x) {
    const bool is_q = e < s.q_width;
    const int j = is_q ? e : e - s.q_width;
    const T* head = (is_q ? q : k) + (j / s.head_size) * s.head_size;
    const T value = rotated(head, cos, sin, j % s.head_size, s.rotary_dim, is_neox);
    (is_q ? q_out + row * s.q_width : k_out + row * s.k_width)[j] = value;
  }
}

bool is_float_type(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
}

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (!is_float_type(x) || weight.scalar_type() != x.scalar_type() || weight.dim() != 1 ||
      weight.size(0) != x.size(-1) || x.numel() == 0)
    return rms_norm_reference(x, weight, eps);
  const c10::cuda::CUDAGuard guard(x.device());
  auto input = x.contiguous();
  auto w = weight.contiguous();
  auto out = at::empty_like(input);
  const int64_t width = input.size(-1);
  const int64_t rows = input.numel() / width;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "frag::rms_norm", [&] {
    rms_norm_kernel<scalar_t><<<rows, kNormThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        input.const_data_ptr<scalar_t>(), w.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), width,
        static_cast<float>(eps));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor silu_and_mul_cuda(const at::Tensor& x) {
  if (!is_float_type(x) || x.size(-1) % 2 != 0 || x.numel() == 0)
    return silu_and_mul_reference(x);
  const c10::cuda::CUDAGuard guard(x.device());
  auto input = x.contiguous();
  const int64_t d = input.size(-1) / 2;
  const int64_t rows = input.numel() / (2 * d);
  auto sizes = input.sizes().vec();
  sizes.back() = d;
  auto out = at::empty(sizes, input.options());
  const int threads = 256;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((d + threads - 1) / threads, 64)),
                  static_cast<unsigned>(rows));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "frag::silu_and_mul", [&] {
    silu_and_mul_kernel<scalar_t><<<grid, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        input.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), d);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

/// Covered: query/key [B, T, n * head_size] with unit stride inside a token (views into qkv are fine),
/// positions [T] or [B, T] of int64, a float32 cache [P, rotary_dim] with an even rotary_dim.
bool rotary_covered(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& cache, int64_t head_size, int64_t rotary_dim) {
  return is_float_type(q) && k.scalar_type() == q.scalar_type() && q.dim() == 3 && k.dim() == 3 &&
         q.stride(2) == 1 && k.stride(2) == 1 && q.size(0) == k.size(0) && q.size(1) == k.size(1) &&
         positions.scalar_type() == at::kLong && (positions.dim() == 1 || positions.dim() == 2) &&
         positions.size(-1) == q.size(1) && (positions.dim() == 1 || positions.size(0) == q.size(0)) &&
         cache.scalar_type() == at::kFloat && cache.dim() == 2 && cache.size(1) == rotary_dim &&
         rotary_dim % 2 == 0 && rotary_dim <= head_size && q.size(2) % head_size == 0 &&
         k.size(2) % head_size == 0 && q.numel() > 0;
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding_cuda(const at::Tensor& positions, const at::Tensor& query,
                                                         const at::Tensor& key, const at::Tensor& cos_sin_cache,
                                                         int64_t head_size, int64_t rotary_dim, bool is_neox) {
  if (!rotary_covered(positions, query, key, cos_sin_cache, head_size, rotary_dim))
    return rotary_embedding_reference(positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox);
  const c10::cuda::CUDAGuard guard(query.device());
  auto pos = positions.contiguous();
  auto cache = cos_sin_cache.contiguous();
  auto q_out = at::empty(query.sizes(), query.options());
  auto k_out = at::empty(key.sizes(), key.options());
  RotaryShape s{query.size(1),
                query.stride(0), query.stride(1), key.stride(0), key.stride(1),
                pos.dim() == 2 ? pos.stride(0) : 0,
                static_cast<int>(query.size(2)), static_cast<int>(key.size(2)), static_cast<int>(head_size),
                static_cast<int>(rotary_dim), cache.size(0)};
  const int64_t rows = query.size(0) * query.size(1);
  const int threads = static_cast<int>(std::min<int64_t>(512, ((s.q_width + s.k_width + 31) / 32) * 32));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "frag::rotary_embedding", [&] {
    rotary_kernel<scalar_t><<<rows, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        pos.const_data_ptr<int64_t>(), query.const_data_ptr<scalar_t>(), key.const_data_ptr<scalar_t>(),
        cache.const_data_ptr<float>(), q_out.mutable_data_ptr<scalar_t>(), k_out.mutable_data_ptr<scalar_t>(), s,
        is_neox);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(frag, CUDA, m) {
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("rotary_embedding", &rotary_embedding_cuda);
  m.impl("silu_and_mul", &silu_and_mul_cuda);
}

}  // namespace frag::runtime
