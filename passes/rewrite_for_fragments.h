//===- passes/rewrite_for_fragments.h - The whole pass pipeline --*- C++ -*-===//
//
// classify_parallel_layers, then insert_fragment_ops, on one module; and the
// same on a clone when only the analysis is wanted (frag inspect); and both
// for a torch.export archive's graph (insert_fragment_ops_pt2.h).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/fragment_table.h"
#include "passes/classify_parallel_layers.h"

#include <nlohmann/json.hpp>
#include <torch/csrc/jit/api/module.h>

#include <vector>

namespace frag::passes {

/// Rewrites `module` in place and returns its fragment table. `source` names
/// the module in errors.
ir::FragmentTable rewrite_for_fragments(torch::jit::Module& module, const LayerAliases& aliases,
                                        const std::string& source);

/// The same in the form `frag rewrite` saves: the ops in each class's own methods
/// (insert_fragment_ops_per_class), so the file holds each class's code once, as the export does.
/// program::prepare_rank inlines it at load.
ir::FragmentTable rewrite_for_file(torch::jit::Module& module, const LayerAliases& aliases, const std::string& source);

/// The fragment table of `module`, including its whole and rank-local
/// locations, without changing it (the rewrite's analysis alone).
ir::FragmentTable analyze_fragments(const torch::jit::Module& module, const LayerAliases& aliases,
                                    const std::string& source);

/// The same for a torch.export archive: `model` is its parsed models/model.json (rewritten in place),
/// `modules` the modules its record describes (runtime::read_exported_program).
ir::FragmentTable rewrite_pt2_for_fragments(nlohmann::json& model,
                                                 const std::vector<ir::ModuleDescription>& modules,
                                                 const LayerAliases& aliases, const std::string& source);

/// The fragment table of an archive's graph, whole and rank-local locations included, without changing
/// `model` (the rewrite runs on a copy).
ir::FragmentTable analyze_pt2_fragments(const nlohmann::json& model,
                                             const std::vector<ir::ModuleDescription>& modules,
                                             const LayerAliases& aliases, const std::string& source);

}  // namespace frag::passes
