//===- program/prepared_rank.h - A rank file made ready to run ---*- C++ -*-===//
//
// The preparation layer sits above passes/ and runtime/: it turns files into a
// program the runtime can execute, and is the only layer that runs passes at
// load. Preparing one rank:
//
//   rank file ──load, check the export across ranks──▶ RankModule
//     plain export:     classify + insert ops (passes/rewrite_for_fragments)
//     rewritten file:   its embedded fragment table
//   fragment table ──index once──▶ ir::LocationTable (ids)
//   forward graph ──bind ops to ids (passes/bind_location_ids)──▶ ready forward
//
// The file's own (string-form) graph is kept beside the bound one: forwards
// specialized to a set of locations are cut from it (program/forward_cache).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/location_table.h"
#include "runtime/rank_context.h"
#include "runtime/rank_module.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/types.h>

#include <memory>
#include <string>

namespace frag::program {

/// One rank's module with its location table, its forward bound to the ids.
struct PreparedRank {
  runtime::RankModule rank;
  std::shared_ptr<const ir::LocationTable> locations;
  /// The rewritten forward as the file holds it (string form), for specializing.
  std::shared_ptr<torch::jit::Graph> file_graph;
};

/// Loads this rank's file onto `device`, checks it against the other ranks'
/// (one export, rank order), rewrites a plain export in memory (`rules_file`
/// declares extra layer classes) and binds the forward to location ids. Every
/// rank fails alike if any rank fails.
PreparedRank prepare_rank(runtime::RankContext& context, const std::string& path, const torch::Device& device,
                          const std::string& rules_file = "");

/// A copy of `prepared`'s file graph keeping the fragment ops only at `kept`,
/// bound to ids, as a function of forward's signature (self first).
std::shared_ptr<torch::jit::GraphFunction> forward_keeping(const PreparedRank& prepared,
                                                           const std::vector<ir::LocationId>& kept,
                                                           const std::string& name);

}  // namespace frag::program
