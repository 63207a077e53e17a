//===- runtime/fragment_ops.cpp - Kernels of frag::gather/intervene/split ===//
//
// Thin kernels over the current InterventionRuntime; with none set, the ops
// pass values through untouched (a rewritten model runs as the original).
// The bound overloads (".at", location ids) are what a loaded program runs.
// The file's string form runs only where nothing bound the graph (a plain
// torch.jit.load): it passes through, and refuses to run under a runtime,
// which could not tell its locations apart.
//
//===----------------------------------------------------------------------===//
#include "ir/error.h"
#include "runtime/intervention_runtime.h"

#include <torch/library.h>

namespace frag::runtime {
namespace {

at::Tensor gather_at(const at::Tensor& piece, int64_t location) {
  auto* runtime = current_intervention_runtime();
  return runtime == nullptr ? piece : runtime->gather(piece, location);
}

at::Tensor intervene_at(const at::Tensor& value, int64_t location, bool fragmented) {
  auto* runtime = current_intervention_runtime();
  return runtime == nullptr ? value : runtime->intervene(value, location, fragmented);
}

at::Tensor split_at(const at::Tensor& value, const at::Tensor& piece, int64_t location) {
  auto* runtime = current_intervention_runtime();
  return runtime == nullptr ? piece : runtime->split(value, piece, location);
}

void refuse_unbound(c10::string_view location) {
  if (current_intervention_runtime() != nullptr)
    fail("the fragment op at {} runs unbound under an intervention runtime: bind the graph to its location table "
         "first (passes::bind_location_ids; ShardedModel::load does)",
         std::string(location.data(), location.size()));
}

at::Tensor gather(const at::Tensor& piece, c10::string_view location, c10::string_view) {
  refuse_unbound(location);
  return piece;
}

at::Tensor intervene(const at::Tensor& value, c10::string_view location, bool) {
  refuse_unbound(location);
  return value;
}

at::Tensor split(const at::Tensor&, const at::Tensor& piece, c10::string_view location, c10::string_view) {
  refuse_unbound(location);
  return piece;
}

}  // namespace

TORCH_LIBRARY_IMPL(frag, CompositeExplicitAutograd, m) {
  m.impl("gather", &gather);
  m.impl("intervene", &intervene);
  m.impl("split", &split);
  m.impl("gather.at", &gather_at);
  m.impl("intervene.at", &intervene_at);
  m.impl("split.at", &split_at);
}

}  // namespace frag::runtime
