//===- passes/rewrite_for_fragments.cpp - The whole pass pipeline --------===//
#include "passes/rewrite_for_fragments.h"

#include "passes/insert_fragment_ops.h"

namespace frag::passes {

ir::FragmentTable rewrite_for_fragments(torch::jit::Module& module, const LayerAliases& aliases,
                                        const std::string& source) {
  ir::FragmentTable table = classify_parallel_layers(module, aliases, source);
  insert_fragment_ops(module, table, source);
  return table;
}

ir::FragmentTable analyze_fragments(const torch::jit::Module& module, const LayerAliases& aliases,
                                    const std::string& source) {
  torch::jit::Module copy = module.clone();
  return rewrite_for_fragments(copy, aliases, source);
}

}  // namespace frag::passes
