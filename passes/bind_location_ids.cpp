//===- passes/bind_location_ids.cpp - Ops by location id, not by name ----===//
#include "passes/bind_location_ids.h"

#include "ir/error.h"
#include "ir/op_schemas.h"

#include <fmt/format.h>
#include <torch/csrc/jit/ir/constants.h>

#include <nlohmann/json.hpp>

#include <map>
#include <optional>
#include <unordered_map>
#include <vector>

namespace frag::passes {
namespace {

using torch::jit::Block;
using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

/// Collects the string-form ops, then replaces them one by one.
class LocationBinder {
 public:
  LocationBinder(Graph& graph, const ir::LocationTable& locations, const std::string& source)
      : graph_(graph), locations_(locations), source_(source) {}

  int64_t run() {
    collect(graph_.block());
    for (Node* node : nodes_) bind(node);
    return static_cast<int64_t>(nodes_.size());
  }

 private:
  void collect(Block* block) {
    for (Node* node : block->nodes()) {
      for (Block* inner : node->blocks()) collect(inner);
      const auto kind = node->kind();
      if (ir::is_fragment_op(kind) && is_string_form(node)) nodes_.push_back(node);
    }
  }

  /// The file's form names its location with a string; the bound form with an int.
  static bool is_string_form(const Node* node) {
    const size_t at = node->kind() == ir::kSplitKind ? 2 : 1;
    return node->inputs().size() > at && node->input(at)->type()->kind() == c10::TypeKind::StringType;
  }

  std::string constant_string(Node* node, size_t index) const {
    auto value = torch::jit::toIValue(node->input(index));
    if (!value || !value->isString())
      fail("{}: {} has a non-constant argument {}; was this graph rewritten by insert_fragment_ops?", source_,
           node->kind().toQualString(), index);
    return value->toStringRef();
  }

  /// The location's id, checking that the node's rule (if any) is the table's.
  ir::LocationId id_for(Node* node, size_t location_index, std::optional<size_t> rule_index) {
    const std::string name = constant_string(node, location_index);
    auto id = locations_.find(name);
    if (!id)
      fail("{}: the graph has a {} at '{}', which its fragment table does not list; the graph and the table "
           "come from different files",
           source_, node->kind().toQualString(), name);
    if (rule_index) {
      // Each distinct rule text is parsed once (a 70B file repeats a handful of rules hundreds of times).
      const std::string rule_text = constant_string(node, *rule_index);
      auto parsed = parsed_rules_.find(rule_text);
      if (parsed == parsed_rules_.end())
        parsed = parsed_rules_.emplace(rule_text, ir::rule_from_json(nlohmann::json::parse(rule_text))).first;
      const auto& side = locations_.at(*id).side;
      if (!side || parsed->second != side->rule)
        fail("{}: the graph's rule at {} differs from its fragment table's", source_, name);
    }
    return *id;
  }

  void bind(Node* node) {
    std::vector<Value*> inputs;
    if (node->kind() == ir::kGatherKind) {
      inputs = {node->input(0), constant_id(id_for(node, 1, 2))};
    } else if (node->kind() == ir::kInterveneKind) {
      inputs = {node->input(0), constant_id(id_for(node, 1, std::nullopt)), node->input(2)};
    } else {
      inputs = {node->input(0), node->input(1), constant_id(id_for(node, 2, 3))};
    }
    Node* bound = graph_.create(node->kind(), inputs, 1)->insertBefore(node);
    bound->output()->copyMetadata(node->output());
    node->output()->replaceAllUsesWith(bound->output());
    std::vector<Node*> constants;
    for (Value* input : node->inputs())
      if (input->node()->kind() == c10::prim::Constant && input->type()->kind() == c10::TypeKind::StringType)
        constants.push_back(input->node());
    node->destroy();
    for (Node* constant : constants)
      if (constant->output()->uses().empty()) constant->destroy();
  }

  /// One int constant per id, at the top of the graph (ids repeat at every visit site of a location).
  Value* constant_id(ir::LocationId id) {
    auto it = id_constants_.find(id);
    if (it != id_constants_.end()) return it->second;
    torch::jit::WithInsertPoint guard(graph_.block()->nodes().front());
    return id_constants_[id] = graph_.insertConstant(static_cast<int64_t>(id));
  }

  Graph& graph_;
  const ir::LocationTable& locations_;
  const std::string& source_;
  std::vector<Node*> nodes_;
  std::unordered_map<std::string, ir::FragmentRule> parsed_rules_;
  std::unordered_map<ir::LocationId, Value*> id_constants_;
};

}  // namespace

int64_t bind_location_ids(torch::jit::Graph& graph, const ir::LocationTable& locations, const std::string& source) {
  return LocationBinder(graph, locations, source).run();
}

}  // namespace frag::passes

namespace frag::passes {

int64_t bind_location_ids_pt2(nlohmann::json& model, const ir::LocationTable& locations,
                                   const std::string& source) {
  // The file's target -> the bound overload, and whether the op carries a rule to check.
  static const std::map<std::string, std::pair<std::string, bool>> kBound = {
      {"torch.ops.frag.gather.default", {"torch.ops.frag.gather.at", true}},
      {"torch.ops.frag.intervene.default", {"torch.ops.frag.intervene.at", false}},
      {"torch.ops.frag.split.default", {"torch.ops.frag.split.at", true}},
  };
  std::unordered_map<std::string, ir::FragmentRule> parsed_rules;
  int64_t bound = 0;
  for (auto& node : model.at("graph_module").at("graph").at("nodes")) {
    auto found = kBound.find(node.at("target").get<std::string>());
    if (found == kBound.end()) continue;
    const std::string what = fmt::format("{}: node {} ({})", source, node.value("name", "?"), found->first);
    nlohmann::json inputs = nlohmann::json::array();
    std::optional<ir::LocationId> id;
    std::string rule_text;
    for (const auto& input : node.at("inputs")) {
      const std::string name = input.value("name", "");
      if (name == "rule") {
        if (!input.at("arg").contains("as_string")) fail("{}: its rule is not a string", what);
        rule_text = input.at("arg").at("as_string").get<std::string>();
        continue;
      }
      if (name == "location") {
        if (!input.at("arg").contains("as_string")) fail("{}: its location is not a string", what);
        const std::string location = input.at("arg").at("as_string").get<std::string>();
        id = locations.find(location);
        if (!id)
          fail("{}: the graph has a fragment op at '{}', which its fragment table does not list; the graph and "
               "the table come from different files",
               source, location);
        inputs.push_back({{"name", "location"}, {"arg", {{"as_int", *id}}}, {"kind", input.value("kind", 1)}});
        continue;
      }
      inputs.push_back(input);
    }
    if (!id) fail("{}: it names no location", what);
    if (found->second.second) {
      auto parsed = parsed_rules.find(rule_text);
      try {
        if (parsed == parsed_rules.end())
          parsed = parsed_rules.emplace(rule_text, ir::rule_from_json(nlohmann::json::parse(rule_text))).first;
      } catch (const nlohmann::json::exception& e) {
        fail("{}: its rule is not valid JSON: {}", what, e.what());
      }
      const auto& side = locations.at(*id).side;
      if (!side || parsed->second != side->rule)
        fail("{}: the graph's rule at {} differs from its fragment table's", source, locations.at(*id).name);
    }
    node["inputs"] = std::move(inputs);
    node["target"] = found->second.first;
    ++bound;
  }
  return bound;
}

}  // namespace frag::passes
