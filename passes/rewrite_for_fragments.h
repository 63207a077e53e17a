//===- passes/rewrite_for_fragments.h - The whole pass pipeline --*- C++ -*-===//
//
// classify_parallel_layers, then insert_fragment_ops, on one module; and the
// same on a clone when only the analysis is wanted (frag inspect).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/fragment_table.h"
#include "passes/classify_parallel_layers.h"

#include <torch/script.h>

namespace frag::passes {

/// Rewrites `module` in place and returns its fragment table. `source` names
/// the module in errors.
ir::FragmentTable rewrite_for_fragments(torch::jit::Module& module, const LayerAliases& aliases,
                                        const std::string& source);

/// The fragment table of `module`, including its whole and rank-local
/// locations, without changing it (the rewrite runs on a clone).
ir::FragmentTable analyze_fragments(const torch::jit::Module& module, const LayerAliases& aliases,
                                    const std::string& source);

}  // namespace frag::passes
