//===- passes/insert_fragment_ops.h - Rewrite with gather/intervene/split -*- C++ -*-===//
//
// The rewrite. Given a module and its fragment table (classify_parallel_layers),
// inlines every submodule call of the root's forward into the root graph and
// inserts, at each call's input and output:
//   fragmented location:  %w = frag::gather(%piece, loc, rule)
//                         %e = frag::intervene(%w, loc, true)
//                         %p = frag::split(%e, %piece, loc, rule)
//   whole location:       %e = frag::intervene(%v, loc, false)
// and rewires the uses. Location and rule travel as constant string arguments,
// because node attributes do not survive save/load.
//
// Why inline: TorchScript shares one method graph among all instances of a
// class (32 decoder layers, one graph), so a location seen inside that graph
// is relative to `self`. Inlining into the root makes every call site one
// instance with one absolute path, baked in as a constant: the runtime needs
// no per-instance lookup, and a location's ops exist exactly where it is
// visited. The cost is a larger root graph, linear in the number of layers.
// That is the form a program runs. A file keeps the class structure instead
// (insert_fragment_ops_per_class: each class's code once, the location taken
// from the instance's path attribute); a load inlines it (inline_fragment_ops).
//
// What each visit gets (triple, lone intervene, or nothing at a rank-local
// value) is decided first, by analyze_location_flow over the same method
// bodies (MethodSpecializer); this pass builds the graph.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/fragment_table.h"
#include "passes/analyze_location_flow.h"
#include "passes/method_specializer.h"

#include <torch/csrc/jit/api/module.h>

namespace frag::passes {

/// Rewrites root.forward in place and fills table.whole and table.rank_local
/// (analyze_location_flow, then the insertion below).
/// Rewrite a module before it first runs: LibTorch keeps the execution plan
/// it built on a first run, so a rewrite after that does not take effect (the
/// CLI and ShardedModel::load always rewrite straight after loading).
/// A module that already holds frag::gather/intervene/split ops is refused
/// (frag::Error naming `source`). The graph lints afterwards.
void insert_fragment_ops(torch::jit::Module& root, ir::FragmentTable& table,
                         const std::string& source);

/// The file form of `frag rewrite`: the ops go into each class's own method graphs, at the call sites
/// where the analysis met them, so a class shared by 80 layers is rewritten and saved once. A location
/// there is `self._frag_path + ".q_proj.output"` (kModulePathAttribute, set on every instance), a
/// constant in root.forward. Where instances of one class would need different ops at one call site (or
/// a module is called from a free function), it rewrites by inlining instead and returns why (else "").
/// Fills table.whole and table.rank_local as insert_fragment_ops does.
std::string insert_fragment_ops_per_class(torch::jit::Module& root, ir::FragmentTable& table,
                                          const std::string& source);

/// Whether `root` is a file rewritten per class (its forward still calls submodules, and holds or
/// reaches fragment ops).
bool is_rewritten_per_class(const torch::jit::Module& root);

/// Makes a file rewritten per class what insert_fragment_ops makes of an export: root.forward inlined,
/// every location a constant; every other method is the export's own again (no fragment op).
void inline_fragment_ops(torch::jit::Module& root, const std::string& source);

/// The insertion alone: `visits` from analyze_location_flow over the same `bodies`.
void insert_fragment_ops(torch::jit::Module& root, const ir::FragmentTable& table,
                         const std::vector<LocationVisit>& visits, MethodSpecializer& bodies,
                         const std::string& source);

}  // namespace frag::passes
