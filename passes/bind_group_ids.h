//===- passes/bind_group_ids.h - The model's collectives by group id -*- C++ -*-===//
//
// An exported model calls frag::all_reduce(x, "tp") and frag::all_gather(x, dim, "tp") for its own
// tensor-parallel communication; the group is a string in the file (readable, independent of how a
// process numbers groups). Before a graph runs, this pass swaps each call whose group is a constant
//   frag::all_reduce(%x, "tp")        -> frag::all_reduce.group(%x, 0)
//   frag::all_gather(%x, %dim, "tp")  -> frag::all_gather.group(%x, %dim, 0)
// with the ir::GroupId of the name (ir/group_id.h), so a forward's collectives index the rank's array of
// groups instead of comparing strings. A group no rank connects is refused (frag::Error naming the file,
// the node and the name); a group that is not a constant is left as it is (looked up by name per call).
//
//===----------------------------------------------------------------------===//
#pragma once

#include <nlohmann/json.hpp>
#include <torch/csrc/jit/ir/ir.h>

#include <string>

namespace frag::passes {

/// Binds, in place, every frag::all_reduce / frag::all_gather of `graph` whose group is a constant to the
/// group's id; `source` names the file in errors. Returns the calls bound.
int64_t bind_group_ids(torch::jit::Graph& graph, const std::string& source);

/// The same on a torch.export graph document (models/model.json of a .pt2): targets
/// torch.ops.frag.all_reduce.default / all_gather.default become the ".group" overloads and the "group"
/// argument an int. For the C++ executor of the archive (program/pt2_nativert_program.h).
int64_t bind_group_ids_pt2(nlohmann::json& model, const std::string& source);

}  // namespace frag::passes
