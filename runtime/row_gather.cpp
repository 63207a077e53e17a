//===- runtime/row_gather.cpp - Rows of several tensors ------------------===//
//
// The checks and the reference form (one index_select per tensor); the fused
// CUDA kernel registers itself from row_gather_cuda.cu where nvcc built it.
//
//===----------------------------------------------------------------------===//
#include "runtime/row_gather.h"

#include "ir/error.h"

#include <ATen/ATen.h>
#include <fmt/ranges.h>

#include <atomic>

namespace frag::runtime {
namespace {

std::atomic<detail::FusedGather> fused_gather{nullptr};

// Whether each row of `t` (its dimensions after the first) is laid out as a contiguous tensor's, from its sizes
// and strides: no select() per tensor and call (the drain calls this every decode step).
bool rows_dense(const at::Tensor& t) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    if (t.size(d) == 0) return true;  // empty rows: nothing to lay out
    if (t.size(d) != 1 && t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

void check(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& indices,
           const std::vector<at::Tensor>& outs) {
  if (indices.size() != srcs.size() || outs.size() != srcs.size())
    fail("gather_rows: {} sources, {} indices and {} outputs: expected one of each per tensor", srcs.size(),
         indices.size(), outs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    const at::Tensor& src = srcs[i];
    const at::Tensor& index = indices[i];
    const at::Tensor& out = outs[i];
    if (src.dim() < 1 || index.dim() != 1 || index.scalar_type() != at::kLong)
      fail("gather_rows: tensor {}: expected a source of at least one dimension and a 1-d int64 index, found "
           "{}-d and {}-d {}", i, src.dim(), index.dim(), c10::toString(index.scalar_type()));
    if (index.device() != src.device() || out.device() != src.device())
      fail("gather_rows: tensor {}: expected its index and output on {}, found {} and {}", i, src.device().str(),
           index.device().str(), out.device().str());
    if (out.scalar_type() != src.scalar_type() || out.dim() != src.dim() || out.size(0) != index.size(0) ||
        out.sizes().slice(1) != src.sizes().slice(1))
      fail("gather_rows: tensor {}: expected an output of {} rows of {} {}, found {} {}", i, index.size(0),
           fmt::join(src.sizes().slice(1), "x"), c10::toString(src.scalar_type()), fmt::join(out.sizes(), "x"),
           c10::toString(out.scalar_type()));
    if (!out.is_contiguous() || !rows_dense(src))
      fail("gather_rows: tensor {}: expected a dense output and dense source rows", i);
  }
}

}  // namespace

void gather_rows(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& indices,
                 const std::vector<at::Tensor>& outs) {
  check(srcs, indices, outs);
  if (srcs.empty()) return;
  detail::FusedGather fused = fused_gather.load();
  if (fused != nullptr && srcs[0].is_cuda()) {
    bool same_device = true;
    for (const at::Tensor& src : srcs) same_device = same_device && src.device() == srcs[0].device();
    if (same_device) return fused(srcs, indices, outs);
  }
  for (size_t i = 0; i < srcs.size(); ++i) {
    at::Tensor out = outs[i];
    at::index_select_out(out, srcs[i], 0, indices[i]);
  }
}

bool gather_rows_fused() { return fused_gather.load() != nullptr; }

namespace detail {
bool set_fused_gather(FusedGather fused) {
  fused_gather.store(fused);
  return true;
}
}  // namespace detail

}  // namespace frag::runtime
