//===- passes/analyze_location_flow.h - What each location visit gets -*- C++ -*-===//
//
// The rewrite's analysis, apart from its insertion: follows values through
// root.forward with every submodule call walked in place (the bodies of a
// MethodSpecializer, nothing copied into a graph) and decides, at each
// module-boundary visit, what the rewrite puts there:
//   fragmented  a parallel layer's input or output (the table's rule): gather, intervene, split;
//   rank-local  a value that derives from a fragment but sits at no fragmented boundary (act_fn
//               between gate_up_proj and down_proj, attention internals): no op;
//   whole       anything else: a lone intervene.
// A value derives from a fragment when any input of the node that made it
// does; the model's own collectives (frag::all_reduce, frag::all_gather) make
// whole values again.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/fragment_table.h"
#include "passes/method_specializer.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/api/module.h>

#include <cstdint>
#include <string>
#include <vector>

namespace frag::passes {

enum class VisitKind : uint8_t { kFragmented, kRankLocal, kWhole };

/// One visit of a location, in the order the rewrite meets them (a module called twice is visited twice).
struct LocationVisit {
  std::string location;
  VisitKind kind;
  /// Where the call sits: the method whose graph holds it (nullptr inside a free function), that call's
  /// index in MethodSpecializer::call_sites(*caller), and the module path of the caller's self.
  torch::jit::GraphFunction* caller = nullptr;
  size_t site = 0;
  std::string caller_path;
};

/// Whether a method of root's tree holds fragment ops (a file rewritten either way: inlined into
/// root.forward, or per class).
bool has_fragment_ops(const torch::jit::Module& root);

/// The visits of root.forward, in walk order. Fills table.whole and table.rank_local (settled: see
/// ir::settle_location_lists). A forward that already holds fragment ops is refused (frag::Error naming
/// `source`).
std::vector<LocationVisit> analyze_location_flow(const torch::jit::Module& root, ir::FragmentTable& table,
                                                 MethodSpecializer& bodies, const std::string& source);

}  // namespace frag::passes
