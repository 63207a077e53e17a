//===- passes/bind_location_ids.h - Ops by location id, not by name -*- C++ -*-===//
//
// A rewritten file carries each location as a constant string (and each rule
// as JSON), because node attributes do not survive save/load and a file should
// not depend on how a process numbers its locations. Before a graph runs, this
// pass swaps every
//   frag::gather(%piece, "loc", "rule")        -> frag::gather.at(%piece, id)
//   frag::intervene(%v, "loc", fragmented)     -> frag::intervene.at(%v, id, fragmented)
//   frag::split(%e, %piece, "loc", "rule")     -> frag::split.at(%e, %piece, id)
// with the ids of an ir::LocationTable, so kernels index a vector. A location
// the table does not know, or a rule that differs from the table's, is
// refused (frag::Error): the graph and its table come from different files.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/location_table.h"

#include <nlohmann/json.hpp>
#include <torch/csrc/jit/ir/ir.h>

#include <string>

namespace frag::passes {

/// Binds, in place, every string-form fragment op of `graph` to its id in
/// `locations`; `source` names the file in errors. Returns the ops bound.
int64_t bind_location_ids(torch::jit::Graph& graph, const ir::LocationTable& locations, const std::string& source);

/// The same on a torch.export graph document (models/model.json of a .pt2 that frag rewrite or
/// insert_fragment_ops_pt2 rewrote): targets torch.ops.frag.<op>.default become the ".at" overloads,
/// the "location" argument an int, the "rule" argument (checked against the table) goes. For a C++
/// executor of the archive (program/pt2_nativert_program.h); Python binds its FX graph itself.
int64_t bind_location_ids_pt2(nlohmann::json& model, const ir::LocationTable& locations,
                                   const std::string& source);

}  // namespace frag::passes
