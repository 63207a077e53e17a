//===- passes/rewrite_for_fragments.cpp - The whole pass pipeline --------===//
#include "passes/rewrite_for_fragments.h"

#include "passes/analyze_location_flow.h"
#include "passes/insert_fragment_ops.h"
#include "passes/insert_fragment_ops_pt2.h"

namespace frag::passes {

ir::FragmentTable rewrite_for_fragments(torch::jit::Module& module, const LayerAliases& aliases,
                                        const std::string& source) {
  ir::FragmentTable table = classify_parallel_layers(module, aliases, source);
  insert_fragment_ops(module, table, source);
  return table;
}

ir::FragmentTable rewrite_for_file(torch::jit::Module& module, const LayerAliases& aliases, const std::string& source) {
  ir::FragmentTable table = classify_parallel_layers(module, aliases, source);
  insert_fragment_ops_per_class(module, table, source);
  return table;
}

ir::FragmentTable analyze_fragments(const torch::jit::Module& module, const LayerAliases& aliases,
                                    const std::string& source) {
  ir::FragmentTable table = classify_parallel_layers(module, aliases, source);
  MethodSpecializer bodies;
  analyze_location_flow(module, table, bodies, source);
  return table;
}

ir::FragmentTable rewrite_pt2_for_fragments(nlohmann::json& model,
                                                 const std::vector<ir::ModuleDescription>& modules,
                                                 const LayerAliases& aliases, const std::string& source) {
  ir::FragmentTable table = classify_parallel_layers(modules, aliases, source);
  insert_fragment_ops_pt2(model, table, source);
  return table;
}

ir::FragmentTable analyze_pt2_fragments(const nlohmann::json& model,
                                             const std::vector<ir::ModuleDescription>& modules,
                                             const LayerAliases& aliases, const std::string& source) {
  nlohmann::json copy = model;
  return rewrite_pt2_for_fragments(copy, modules, aliases, source);
}

}  // namespace frag::passes
