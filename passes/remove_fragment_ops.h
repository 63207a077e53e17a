//===- passes/remove_fragment_ops.h - Drop the fragment ops nobody waits at -*- C++ -*-===//
//
// Specializes a rewritten graph to a set of locations: every
//   %w = frag::gather(%piece, loc, rule); %e = frag::intervene(%w, loc, true);
//   %p = frag::split(%e, %piece, loc, rule)
// triple and every lone frag::intervene(%v, loc, false) whose location is not
// kept is removed, its uses wired to %piece (or %v). What is left computes
// exactly what the original export computes wherever nothing is kept, with no
// op to dispatch there.
//
// Why: an idle triple costs a dispatch and a lookup (~0.2 us); hundreds per
// forward show on a small model. The runtime (ShardedModel) runs a copy of
// the graph specialized to the locations with interventions and keeps the
// full rewrite for when they change; saved files always hold the full rewrite.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <torch/csrc/jit/ir/ir.h>

#include <string>
#include <unordered_set>

namespace frag::passes {

/// Removes, in place, the frag::gather/intervene/split ops at every location
/// not in `kept`. A triple whose nodes are not wired as insert_fragment_ops
/// wires them is refused (frag::Error) before anything changes.
/// Returns the number of op groups removed: one per visit site (a triple or a
/// lone intervene), so a location called twice counts twice.
int64_t remove_fragment_ops_except(torch::jit::Graph& graph, const std::unordered_set<std::string>& kept);

/// Removes every frag::gather/intervene/split op, wherever its location comes from (a constant, or a
/// value computed from self in a file rewritten per class). The same wiring checks; returns the number
/// of op groups removed.
int64_t remove_all_fragment_ops(torch::jit::Graph& graph);

}  // namespace frag::passes
