//===- passes/insert_fragment_ops_pt2.h - The rewrite of a .pt2 graph -*- C++ -*-===//
//
// The rewrite of insert_fragment_ops.h for a torch.export archive's graph
// (models/model.json, schema 8), with the same locations, ops and tables:
//   fragmented location:  whole = frag.gather(piece, loc, rule)
//                         edited = frag.intervene(whole, loc, true)
//                         piece' = frag.split(edited, piece, loc, rule)
//   whole location:       value' = frag.intervene(value, loc, false)
//   rank-local location:  no op (listed in table.rank_local)
//
// Where a module's boundary is: the kit exports with every submodule's call
// signature preserved (torch.export's preserve_module_call_signature), so
// module_call_graph names each call's inputs and outputs. `.input` is the
// first input (when a tensor), `.output` the first output, as in TorchScript.
// An exported graph is flat: a value crosses a boundary on its way from its
// producer's module to a consumer's module (nn_module_stack). Each consumer
// gets the value after every boundary on that way (leaving modules innermost
// first, then entering them outermost first); a boundary's ops are made once
// per value, before the first consumer that needs them, and shared.
//
// Inserted nodes carry tensor metadata (a gathered whole: the whole shape,
// contiguous strides) and the nn_module_stack of the call site.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/fragment_table.h"

#include <nlohmann/json.hpp>

#include <string>

namespace frag::passes {

/// Rewrites the graph of `model` (a parsed models/model.json) in place and fills table.whole and
/// table.rank_local. Refused (frag::Error naming `source`): a graph without preserved call signatures,
/// one that already holds fragment ops, a node the pass cannot place (a nested graph).
void insert_fragment_ops_pt2(nlohmann::json& model, ir::FragmentTable& table, const std::string& source);

/// Whether the graph of `model` already holds ops inserted by insert_fragment_ops_pt2.
bool has_fragment_ops_pt2(const nlohmann::json& model);

}  // namespace frag::passes
