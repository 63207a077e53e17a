//===- passes/bind_group_ids.cpp - The model's collectives by group id ---===//
#include "passes/bind_group_ids.h"

#include "ir/error.h"
#include "ir/group_id.h"
#include "ir/op_schemas.h"

#include <fmt/format.h>
#include <torch/csrc/jit/ir/constants.h>

#include <map>
#include <vector>

namespace frag::passes {
namespace {

using torch::jit::Block;
using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

/// The group's id, or a frag::Error naming the node and the name.
ir::GroupId checked_group(const std::string& name, const std::string& source, const std::string& node) {
  auto id = ir::group_id(name);
  if (!id)
    fail("{}: {} names the group '{}', which no rank connects (known: {}, {}, {}, {})", source, node, name,
         ir::kTpGroup, ir::kEpGroup, ir::kTpEpGroup, ir::kWorldGroup);
  return *id;
}

/// Collects the string-form collectives, then replaces them one by one.
class GroupBinder {
 public:
  GroupBinder(Graph& graph, const std::string& source) : graph_(graph), source_(source) {}

  int64_t run() {
    collect(graph_.block());
    for (Node* node : nodes_) bind(node);
    return static_cast<int64_t>(nodes_.size());
  }

 private:
  void collect(Block* block) {
    for (Node* node : block->nodes()) {
      for (Block* inner : node->blocks()) collect(inner);
      if (node->kind() != ir::kAllReduceKind && node->kind() != ir::kAllGatherKind) continue;
      Value* group = node->inputs().back();
      if (group->type()->kind() == c10::TypeKind::StringType && torch::jit::toIValue(group)) nodes_.push_back(node);
    }
  }

  void bind(Node* node) {
    const std::string name = torch::jit::toIValue(node->inputs().back())->toStringRef();
    const auto id = checked_group(name, source_, node->kind().toQualString());
    std::vector<Value*> inputs(node->inputs().begin(), node->inputs().end() - 1);
    inputs.push_back(constant_id(id));
    Node* bound = graph_.create(node->kind(), inputs, 1)->insertBefore(node);
    bound->output()->copyMetadata(node->output());
    node->output()->replaceAllUsesWith(bound->output());
    Node* constant = node->inputs().back()->node();
    node->destroy();
    if (constant->kind() == c10::prim::Constant && constant->output()->uses().empty()) constant->destroy();
  }

  /// One int constant per group, at the top of the graph.
  Value* constant_id(ir::GroupId id) {
    auto& value = id_constants_[id];
    if (value == nullptr) {
      torch::jit::WithInsertPoint guard(graph_.block()->nodes().front());
      value = graph_.insertConstant(static_cast<int64_t>(id));
    }
    return value;
  }

  Graph& graph_;
  const std::string& source_;
  std::vector<Node*> nodes_;
  std::map<ir::GroupId, Value*> id_constants_;
};

}  // namespace

int64_t bind_group_ids(torch::jit::Graph& graph, const std::string& source) {
  return GroupBinder(graph, source).run();
}

int64_t bind_group_ids_pt2(nlohmann::json& model, const std::string& source) {
  static const std::map<std::string, std::string> kBound = {
      {"torch.ops.frag.all_reduce.default", "torch.ops.frag.all_reduce.group"},
      {"torch.ops.frag.all_gather.default", "torch.ops.frag.all_gather.group"},
  };
  int64_t bound = 0;
  for (auto& node : model.at("graph_module").at("graph").at("nodes")) {
    auto found = kBound.find(node.at("target").get<std::string>());
    if (found == kBound.end()) continue;
    const std::string what = fmt::format("node {} ({})", node.value("name", "?"), found->first);
    bool is_constant = false;
    for (auto& input : node.at("inputs")) {
      if (input.value("name", "") != "group" || !input.at("arg").contains("as_string")) continue;
      const auto id = checked_group(input.at("arg").at("as_string").get<std::string>(), source, what);
      input["arg"] = {{"as_int", static_cast<int64_t>(id)}};
      is_constant = true;
    }
    if (!is_constant) continue;  // a computed group stays looked up by name
    node["target"] = found->second;
    ++bound;
  }
  return bound;
}

}  // namespace frag::passes
