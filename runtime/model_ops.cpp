//===- runtime/model_ops.cpp - The model's own collectives as ops --------===//
//
// Exported models call torch.ops.frag.all_reduce / all_gather for their
// tensor-parallel communication (fragkit.distributed and the kit's layers).
// These kernels route each call to the current RankContext's named group.
// The schemas live in ir/op_schemas.h, the contract with the pass and with
// tools/fragkit/ops.py.
//
//===----------------------------------------------------------------------===//
#include "runtime/rank_context.h"

#include <torch/library.h>

namespace frag::runtime {
namespace {

// Op kernels: the dispatcher hands "str" arguments over as string views (no copy per call).
at::Tensor all_reduce(const at::Tensor& x, c10::string_view group) {
  return current_rank_context().group(std::string(group)).all_reduce(x);
}

at::Tensor all_gather(const at::Tensor& x, int64_t dim, c10::string_view group) {
  auto pieces = current_rank_context().group(std::string(group)).all_gather(x);
  return torch::cat(pieces, dim);
}

}  // namespace

TORCH_LIBRARY_IMPL(frag, CompositeExplicitAutograd, m) {
  m.impl("all_reduce", &all_reduce);
  m.impl("all_gather", &all_gather);
}

}  // namespace frag::runtime
