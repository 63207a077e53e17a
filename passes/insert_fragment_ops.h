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
//
// A value that derives from a fragment but sits at no fragmented boundary
// (act_fn between gate_up_proj and down_proj, attention internals) is
// rank-local: it gets no op, and is listed in table.rank_local with the
// fragmented location it derives from.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/fragment_table.h"

#include <torch/script.h>

namespace frag::passes {

/// Rewrites root.forward in place and fills table.whole and table.rank_local.
/// Rewrite a module before it first runs: LibTorch keeps the execution plan
/// it built on a first run, so a rewrite after that does not take effect (the
/// CLI and ShardedModel::load always rewrite straight after loading).
/// A module that already holds frag::gather/intervene/split ops is refused
/// (frag::Error naming `source`). The graph lints afterwards.
void insert_fragment_ops(torch::jit::Module& root, ir::FragmentTable& table,
                         const std::string& source);

/// Whether root.forward already holds ops inserted by insert_fragment_ops.
bool has_fragment_ops(const torch::jit::Module& root);

}  // namespace frag::passes
