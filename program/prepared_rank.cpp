//===- program/prepared_rank.cpp - A rank file made ready to run ---------===//
#include "program/prepared_rank.h"

#include "ir/error.h"
#include "passes/bind_group_ids.h"
#include "passes/bind_location_ids.h"
#include "passes/insert_fragment_ops.h"
#include "passes/remove_fragment_ops.h"
#include "passes/rewrite_for_fragments.h"

#include <torch/csrc/jit/api/function_impl.h>

#include <unordered_set>

namespace frag::program {
namespace {

std::shared_ptr<torch::jit::Graph> forward_graph_of(const torch::jit::Module& module) {
  return torch::jit::toGraphFunction(module.get_method("forward").function()).graph();
}

}  // namespace

PreparedRank prepare_rank(runtime::RankContext& context, const std::string& path, const torch::Device& device,
                          const std::string& rules_file) {
  PreparedRank prepared;
  prepared.rank = runtime::load_and_check_rank_module(context, path, device);
  std::string error;
  try {
    ir::FragmentTable table;
    const auto& extra = prepared.rank.extra_files;
    if (auto it = extra.find(runtime::kRuleTableFile); it != extra.end()) {
      nlohmann::json json;
      try {
        json = nlohmann::json::parse(it->second);
      } catch (const nlohmann::json::exception& e) {
        fail("{}: its fragment table ({}) is not valid JSON: {}", path, runtime::kRuleTableFile, e.what());
      }
      table = ir::table_from_json(json, path);
      // frag rewrite's file holds the ops in each class's methods: one forward with constant locations
      // is what the runtime binds and specializes.
      if (passes::is_rewritten_per_class(prepared.rank.module)) passes::inline_fragment_ops(prepared.rank.module, path);
    } else {
      auto aliases = rules_file.empty() ? passes::LayerAliases{} : passes::LayerAliases::from_file(rules_file);
      table = passes::rewrite_for_fragments(prepared.rank.module, aliases, path);
    }
    prepared.locations = std::make_shared<const ir::LocationTable>(std::move(table));
    // Bind the module's own forward before it first runs (LibTorch keeps the
    // plan it builds then); keep the file's form for specializations.
    auto graph = forward_graph_of(prepared.rank.module);
    prepared.file_graph = graph->copy();
    passes::bind_location_ids(*graph, *prepared.locations, path);
    passes::bind_group_ids(*graph, path);
  } catch (const Error& e) {
    error = e.what();
  }
  context.agree("rewrite", error);
  return prepared;
}

std::shared_ptr<torch::jit::GraphFunction> forward_keeping(const PreparedRank& prepared,
                                                           const std::vector<ir::LocationId>& kept,
                                                           const std::string& name) {
  std::unordered_set<std::string> names;
  for (auto id : kept) names.insert(prepared.locations->at(id).name);
  auto graph = prepared.file_graph->copy();
  passes::remove_fragment_ops_except(*graph, names);
  passes::bind_location_ids(*graph, *prepared.locations, prepared.rank.path);
  passes::bind_group_ids(*graph, prepared.rank.path);
  return std::make_shared<torch::jit::GraphFunction>(c10::QualifiedName(name), std::move(graph), nullptr);
}

}  // namespace frag::program
