//===- program/exported_rank.h - A .pt2 rank file made ready for torch.export -*- C++ -*-===//
//
// The preparation of a torch.export archive for a process that runs it with
// PyTorch (the Python front end): read the archive, check it across ranks
// (one export, rank order), rewrite a plain export in memory
// (passes/insert_fragment_ops_exported) or take the rewritten file's embedded
// table, and index the table once (ir::LocationTable). The graph itself is run
// by torch.export in Python, its fragment ops bound there to the same ids
// (python/fragments/_exported.py).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/location_table.h"
#include "runtime/rank_context.h"

#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace frag::program {

struct PreparedExport {
  std::shared_ptr<const ir::LocationTable> locations;
  /// The rewritten graph (models/model.json), ops in the file's form.
  nlohmann::json model;
  /// The dtype of the first floating-point parameter (the model computes in it).
  at::ScalarType dtype = at::kFloat;
  /// The rewritten archive, where the file is a plain export (rewritten here, in memory); empty where the
  /// file is one frag rewrite wrote: load the file itself.
  std::string rewritten;
  /// (path, class name) of every module the archive names and of their parents (containers such as a
  /// ModuleList run no node: their class is ""), the root as "" first; parents before children.
  std::vector<std::pair<std::string, std::string>> modules;
  /// The integer config the kit recorded per module path (head_size, input_size, …).
  std::map<std::string, std::map<std::string, int64_t>> attributes;
};

/// Prepares this rank's .pt2 file; every rank fails alike if any rank fails.
PreparedExport prepare_exported_rank(runtime::RankContext& context, const std::string& path,
                                     const std::string& rules_file = "");

}  // namespace frag::program
