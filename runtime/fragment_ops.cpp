//===- runtime/fragment_ops.cpp - Kernels of frag::gather/intervene/split ===//
//
// Thin kernels over the current InterventionRuntime; with none set, the ops
// pass values through untouched (a rewritten model runs as the original).
//
//===----------------------------------------------------------------------===//
#include "runtime/intervention_runtime.h"

#include <torch/library.h>

namespace frag::runtime {
namespace {

at::Tensor gather(const at::Tensor& piece, std::string location, std::string rule) {
  auto* runtime = current_intervention_runtime();
  return runtime == nullptr ? piece : runtime->gather(piece, location, rule);
}

at::Tensor intervene(const at::Tensor& value, std::string location, bool fragmented) {
  auto* runtime = current_intervention_runtime();
  return runtime == nullptr ? value : runtime->intervene(value, location, fragmented);
}

at::Tensor split(const at::Tensor& value, const at::Tensor& piece, std::string location,
                 std::string rule) {
  auto* runtime = current_intervention_runtime();
  return runtime == nullptr ? piece : runtime->split(value, piece, location, rule);
}

}  // namespace

TORCH_LIBRARY_IMPL(frag, CompositeExplicitAutograd, m) {
  m.impl("gather", &gather);
  m.impl("intervene", &intervene);
  m.impl("split", &split);
}

}  // namespace frag::runtime
