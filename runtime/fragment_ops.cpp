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

// The string arguments are views of the graph's constants: no copies per call.
std::string_view view(c10::string_view text) { return {text.data(), text.size()}; }

at::Tensor gather(const at::Tensor& piece, c10::string_view location, c10::string_view rule) {
  auto* runtime = current_intervention_runtime();
  return runtime == nullptr ? piece : runtime->gather(piece, view(location), view(rule));
}

at::Tensor intervene(const at::Tensor& value, c10::string_view location, bool fragmented) {
  auto* runtime = current_intervention_runtime();
  return runtime == nullptr ? value : runtime->intervene(value, view(location), fragmented);
}

at::Tensor split(const at::Tensor& value, const at::Tensor& piece, c10::string_view location,
                 c10::string_view rule) {
  auto* runtime = current_intervention_runtime();
  return runtime == nullptr ? piece : runtime->split(value, piece, view(location), view(rule));
}

}  // namespace

TORCH_LIBRARY_IMPL(frag, CompositeExplicitAutograd, m) {
  m.impl("gather", &gather);
  m.impl("intervene", &intervene);
  m.impl("split", &split);
}

}  // namespace frag::runtime
