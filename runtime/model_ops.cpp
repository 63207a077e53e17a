//===- runtime/model_ops.cpp - The model's own collectives as ops --------===//
//
// Exported models call torch.ops.frag.all_reduce / all_gather for their
// tensor-parallel communication (fragkit.distributed and the kit's layers).
// These kernels route each call to the current RankContext's named group; at load
// passes/bind_group_ids swaps constant names for ids (the ".group" overloads).
// The schemas live in ir/op_schemas.h, the contract with the pass and with
// fragkit/ops.py.
//
//===----------------------------------------------------------------------===//
#include "runtime/rank_context.h"

#include <torch/library.h>

namespace frag::runtime {
namespace {

// The kernels' C++ signatures are the ops' typed interface (callers use
// typed<Tensor(const Tensor&, std::string)>, and a string_view kernel refuses them): `group` stays a
// std::string by value, a copy next to a collective.
at::Tensor all_reduce(const at::Tensor& x, std::string group) {  // NOLINT(performance-unnecessary-value-param)
  return current_rank_context().group(group).all_reduce(x);
}

at::Tensor all_gather(const at::Tensor& x, int64_t dim,
                      std::string group) {  // NOLINT(performance-unnecessary-value-param)
  auto pieces = current_rank_context().group(group).all_gather(x);
  return torch::cat(pieces, dim);
}

/// The bound forms (passes/bind_group_ids): the group by id, an index into the rank's groups.
at::Tensor all_reduce_group(const at::Tensor& x, int64_t group) {
  return current_rank_context().group(static_cast<ir::GroupId>(group)).all_reduce(x);
}

at::Tensor all_gather_group(const at::Tensor& x, int64_t dim, int64_t group) {
  return torch::cat(current_rank_context().group(static_cast<ir::GroupId>(group)).all_gather(x), dim);
}

}  // namespace

TORCH_LIBRARY_IMPL(frag, CompositeExplicitAutograd, m) {
  m.impl("all_reduce", &all_reduce);
  m.impl("all_gather", &all_gather);
  m.impl("all_reduce.group", &all_reduce_group);
  m.impl("all_gather.group", &all_gather_group);
}

}  // namespace frag::runtime
