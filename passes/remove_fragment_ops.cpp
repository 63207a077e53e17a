//===- passes/remove_fragment_ops.cpp - Drop the fragment ops nobody waits at ===//
#include "passes/remove_fragment_ops.h"

#include "ir/error.h"
#include "ir/op_schemas.h"

#include <torch/csrc/jit/ir/constants.h>

#include <algorithm>
#include <vector>

namespace frag::passes {
namespace {

using torch::jit::Block;
using torch::jit::Node;

/// Finds the op groups to drop, checks their wiring, then removes them.
class FragmentOpRemover {
 public:
  /// Removes the ops at every location not in `kept`; all of them when `kept` is nullptr.
  explicit FragmentOpRemover(const std::unordered_set<std::string>* kept) : kept_(kept) {}

  int64_t run(torch::jit::Graph& graph) {
    collect(graph.block());
    // A split is the last node of its triple: removing from it backwards
    // leaves no dangling use at any step.
    for (Node* split : splits_) {
      Node* intervene = split->input(0)->node();
      Node* gather = intervene->input(0)->node();
      split->output()->replaceAllUsesWith(split->input(1));
      destroy_with_constants(split);
      destroy_with_constants(intervene);
      destroy_with_constants(gather);
    }
    for (Node* intervene : lone_intervenes_) {
      intervene->output()->replaceAllUsesWith(intervene->input(0));
      destroy_with_constants(intervene);
    }
    return static_cast<int64_t>(splits_.size() + lone_intervenes_.size());
  }

 private:
  /// Destroys `node` and the constants (location, rule, flag) only it used.
  static void destroy_with_constants(Node* node) {
    std::vector<Node*> constants;
    for (auto* input : node->inputs())
      if (input->node()->kind() == c10::prim::Constant &&
          std::find(constants.begin(), constants.end(), input->node()) == constants.end())
        constants.push_back(input->node());
    node->destroy();
    for (Node* constant : constants)
      if (constant->output()->uses().empty()) constant->destroy();
  }

  static std::string location_of(Node* node, size_t index) {
    auto value = torch::jit::toIValue(node->input(index));
    if (!value || !value->isString())
      fail("{}: its location argument is not a constant string; was this graph rewritten by insert_fragment_ops?",
           node->kind().toQualString());
    return value->toStringRef();
  }

  void collect(Block* block) {
    for (Node* node : block->nodes()) {
      for (Block* inner : node->blocks()) collect(inner);
      if (node->kind() == ir::kSplitKind) {
        if (kept_ == nullptr) {
          splits_.push_back(checked_triple(node, nullptr));
          continue;
        }
        const std::string location = location_of(node, 2);
        if (kept_->count(location) == 0) splits_.push_back(checked_triple(node, &location));
      } else if (node->kind() == ir::kInterveneKind) {
        auto fragmented = torch::jit::toIValue(node->input(2));
        if (!fragmented || !fragmented->isBool())
          fail("frag::intervene at {}: its 'fragmented' argument is not a constant",
               kept_ == nullptr ? std::string("a location computed at run time") : location_of(node, 1));
        if (fragmented->toBool()) continue;
        if (kept_ == nullptr || kept_->count(location_of(node, 1)) == 0) lone_intervenes_.push_back(node);
      }
    }
  }

  /// The split of a gather → intervene → split chain whose middle values
  /// have no other use (so dropping the chain loses nothing).
  /// `location`: the triple's, checked on all three ops (nullptr: they must share one location value).
  static Node* checked_triple(Node* split, const std::string* location) {
    auto wired = [&] {
      Node* intervene = split->input(0)->node();
      if (intervene->kind() != ir::kInterveneKind || intervene->output()->uses().size() != 1) return false;
      auto fragmented = torch::jit::toIValue(intervene->input(2));
      if (!fragmented || !fragmented->isBool() || !fragmented->toBool()) return false;
      Node* gather = intervene->input(0)->node();
      if (gather->kind() != ir::kGatherKind || gather->output()->uses().size() != 1 ||
          gather->input(0) != split->input(1))
        return false;
      if (location == nullptr) return intervene->input(1) == split->input(2) && gather->input(1) == split->input(2);
      return location_of(intervene, 1) == *location && location_of(gather, 1) == *location;
    };
    if (!wired())
      fail("frag::split at {}: not the end of a gather -> intervene -> split triple over one piece; "
           "the graph was changed after insert_fragment_ops",
           location == nullptr ? std::string("a location computed at run time") : *location);
    return split;
  }

  const std::unordered_set<std::string>* kept_;
  std::vector<Node*> splits_;
  std::vector<Node*> lone_intervenes_;
};

}  // namespace

int64_t remove_fragment_ops_except(torch::jit::Graph& graph, const std::unordered_set<std::string>& kept) {
  return FragmentOpRemover(&kept).run(graph);
}

int64_t remove_all_fragment_ops(torch::jit::Graph& graph) { return FragmentOpRemover(nullptr).run(graph); }

}  // namespace frag::passes
