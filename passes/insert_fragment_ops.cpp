//===- passes/insert_fragment_ops.cpp - Rewrite with gather/intervene/split ===//
#include "passes/insert_fragment_ops.h"

#include "ir/error.h"
#include "ir/op_schemas.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/jit_log.h>
#include <torch/csrc/jit/passes/constant_propagation.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <unordered_map>

namespace frag::passes {
namespace {

using torch::jit::Block;
using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;
using torch::jit::WithInsertPoint;

const c10::Symbol kGather = c10::Symbol::fromQualString(ir::kGatherOp);
const c10::Symbol kIntervene = c10::Symbol::fromQualString(ir::kInterveneOp);
const c10::Symbol kSplit = c10::Symbol::fromQualString(ir::kSplitOp);
const c10::Symbol kAllReduce = c10::Symbol::fromQualString(ir::kAllReduceOp);
const c10::Symbol kAllGather = c10::Symbol::fromQualString(ir::kAllGatherOp);

bool is_fragment_op(const Node* node) {
  return node->kind() == kGather || node->kind() == kIntervene || node->kind() == kSplit;
}

bool any_fragment_op(const Block* block) {
  for (const Node* node : block->nodes()) {
    if (is_fragment_op(node)) return true;
    for (const Block* inner : node->blocks())
      if (any_fragment_op(inner)) return true;
  }
  return false;
}

std::string join_path(const std::string& parent, const std::string& name) {
  return parent.empty() ? name : parent + "." + name;
}

/// Inlines submodule calls into the root graph and inserts the fragment ops.
class FragmentOpInserter {
 public:
  FragmentOpInserter(torch::jit::Module& root, ir::FragmentTable& table, const std::string& source)
      : root_(root), table_(table), source_(source) {}

  void run() {
    auto& function = torch::jit::toGraphFunction(root_.get_method("forward").function());
    graph_ = function.graph();
    if (any_fragment_op(graph_->block()))
      fail("{}: already rewritten (its forward holds frag:: fragment ops); rewrite the original export",
           source_);
    self_ = graph_->inputs().at(0);
    for (const auto& layer : table_.layers) {
      if (layer.input) rules_[ir::input_location(layer.path)] = &layer.input->rule;
      if (layer.output) rules_[ir::output_location(layer.path)] = &layer.output->rule;
    }
    GRAPH_DUMP("before insert_fragment_ops:", graph_);
    process_block(graph_->block());
    settle_location_lists();
    GRAPH_DUMP("after insert_fragment_ops:", graph_);
    // Graph::lint is quadratic in LibTorch (nodes × blocks): about a second
    // for 80 layers. The pass tests lint every rewritten graph; set
    // FRAG_LINT=1 to lint here too.
    if (const char* lint = std::getenv("FRAG_LINT"); lint != nullptr && std::string(lint) == "1") graph_->lint();
  }

 private:
  void process_block(Block* block) { process_range(block->nodes().front(), block->return_node()); }

  /// Processes the nodes from `node` up to (not including) `end`.
  void process_range(Node* node, Node* end) {
    while (node != end) {
      Node* next = node->next();
      if (node->kind() == c10::prim::CallMethod) {
        next = handle_call(node);
      } else if (node->kind() == c10::prim::CallFunction) {
        next = inline_function(node);
      } else if (!is_fragment_op(node)) {
        for (Block* inner : node->blocks()) process_block(inner);
        propagate_rank_local(node);
      }
      node = next;
    }
  }

  /// A module called several times lists its locations once. A location whole
  /// on one call and rank-local on another is rank-local: no hook may rely on
  /// seeing a whole value there.
  void settle_location_lists() {
    std::vector<std::string> whole;
    for (const auto& location : table_.whole) {
      const bool local = std::any_of(table_.rank_local.begin(), table_.rank_local.end(),
                                     [&](const auto& l) { return l.location == location; });
      if (!local && std::find(whole.begin(), whole.end(), location) == whole.end()) whole.push_back(location);
    }
    table_.whole = std::move(whole);
    std::vector<ir::RankLocalLocation> rank_local;
    for (const auto& local : table_.rank_local)
      if (std::none_of(rank_local.begin(), rank_local.end(), [&](const auto& l) { return l.location == local.location; }))
        rank_local.push_back(local);
    table_.rank_local = std::move(rank_local);
  }

  /// Marks a node's outputs rank-local when any input (or inner block result) is.
  /// The model's own collectives make whole values.
  void propagate_rank_local(Node* node) {
    if (node->kind() == kAllReduce || node->kind() == kAllGather) return;
    const std::string* source = nullptr;
    for (Value* input : node->inputs())
      if (auto it = derived_from_.find(input); source == nullptr && it != derived_from_.end())
        source = &it->second;
    for (Block* inner : node->blocks())
      for (Value* result : inner->outputs())
        if (auto it = derived_from_.find(result); source == nullptr && it != derived_from_.end())
          source = &it->second;
    if (source == nullptr) return;
    const std::string origin = *source;
    for (Value* output : node->outputs()) derived_from_[output] = origin;
  }

  /// The module path of a class-typed value: a GetAttr chain from the root's self.
  std::optional<std::string> module_path(Value* value) const {
    if (value == self_) return std::string();
    Node* node = value->node();
    if (node->kind() != c10::prim::GetAttr) return std::nullopt;
    auto parent = module_path(node->input(0));
    if (!parent) return std::nullopt;
    return join_path(*parent, node->s(c10::attr::name));
  }

  torch::jit::Module module_at(const std::string& path) const {
    torch::jit::Module module = root_;
    size_t start = 0;
    while (start < path.size()) {
      size_t end = path.find('.', start);
      if (end == std::string::npos) end = path.size();
      module = module.attr(path.substr(start, end - start)).toModule();
      start = end + 1;
    }
    return module;
  }

  /// Instruments a submodule call's input, inlines the call, processes the
  /// inlined body (deeper calls first, so rank-local values are known), then
  /// instruments the output. Returns the node after the call's region.
  Node* handle_call(Node* call) {
    Node* const before = call->prev();
    Node* const after = call->next();
    const std::string method = call->s(c10::attr::name);
    auto path = module_path(call->input(0));
    if (!path) fail("{}: a method call on a module the pass cannot resolve to a path", source_);
    torch::jit::Module callee_module = module_at(*path);
    auto& callee = torch::jit::toGraphFunction(callee_module.get_method(method).function());
    const bool located = !path->empty() && method == "forward";
    if (located && call->inputs().size() >= 2 &&
        call->input(1)->type()->isSubtypeOf(*c10::TensorType::get()))
      call->replaceInput(1, instrument(call->input(1), ir::input_location(*path), call));
    auto body = specialize(callee, callee_module);
    auto outputs = torch::jit::inlineCallTo(call, &callee, body.get());
    // Holds the call's result while the body is processed: inlining a deeper
    // call replaces its output value (`return self.norm(x)`), and the holder's
    // input follows that replacement.
    Node* holder = nullptr;
    if (located && outputs.size() == 1) {
      WithInsertPoint guard(after);
      holder = graph_->insertNode(graph_->create(c10::prim::TupleConstruct, {outputs[0]}, 1));
    }
    process_range(before->next(), holder != nullptr ? holder : after);
    if (holder != nullptr) {
      Value* result = holder->input(0);
      holder->destroy();
      instrument_output(result, ir::output_location(*path), after);
    }
    return after;
  }

  /// Inlines a free function (fragkit.distributed's all-reduce, a rotary
  /// helper): the model's collectives must be visible to the rank-local
  /// analysis. Returns the node after the inlined region.
  Node* inline_function(Node* call) {
    Node* const before = call->prev();
    Node* const after = call->next();
    auto function_type = call->input(0)->type()->cast<c10::FunctionType>();
    auto* function = function_type ? torch::jit::tryToGraphFunction(*function_type->function()) : nullptr;
    if (function == nullptr) {  // not a TorchScript function: leave it, treat as an ordinary op
      propagate_rank_local(call);
      return after;
    }
    call->removeInput(0);  // the function constant; the callee takes the rest
    torch::jit::inlineCallTo(call, function, function->graph().get());
    process_range(before->next(), after);
    return after;
  }

  /// A copy of the callee's own graph (not its optimized, already inlined
  /// one: its submodule calls must stay visible so they get locations too),
  /// with this instance's scalar config attributes folded into constants and
  /// the branches they decide removed. After inlining the graph belongs to one
  /// instance, so this is exact; it also tells the rank-local analysis that,
  /// say, a RowParallelLinear with reduce_results=True returns an all-reduced
  /// value on every path.
  /// Instances of one class with equal folded config (the 80 decoder layers
  /// of one file) share one specialized body, keyed by class, method and the
  /// folded values.
  std::shared_ptr<Graph> specialize(torch::jit::GraphFunction& callee, const torch::jit::Module& instance) {
    const auto& source = callee.graph();
    Value* source_self = source->inputs().at(0);
    std::vector<std::pair<std::string, c10::IValue>> folded;
    std::string key = fmt::format("{}|{}", static_cast<const void*>(instance.type().get()), callee.name());
    for (const auto& use : source_self->uses()) {
      if (use.user->kind() != c10::prim::GetAttr) continue;
      const std::string name = use.user->s(c10::attr::name);
      if (!instance.hasattr(name)) continue;
      c10::IValue value = instance.attr(name);
      if (!(value.isBool() || value.isInt() || value.isDouble() || value.isString() || value.isNone())) continue;
      key += fmt::format("|{}={}", name, value.isNone() ? std::string("None") : c10::str(value));
      folded.emplace_back(name, value);
    }
    if (auto cached = specialized_.find(key); cached != specialized_.end()) return cached->second;
    auto body = source->copy();
    Value* self = body->inputs().at(0);
    std::vector<Node*> reads;
    for (const auto& use : self->uses())
      if (use.user->kind() == c10::prim::GetAttr) reads.push_back(use.user);
    for (Node* read : reads) {
      const std::string name = read->s(c10::attr::name);
      auto value = std::find_if(folded.begin(), folded.end(), [&](const auto& f) { return f.first == name; });
      if (value == folded.end()) continue;
      WithInsertPoint guard(read);
      read->output()->replaceAllUsesWith(body->insertConstant(value->second));
      read->destroy();
    }
    torch::jit::ConstantPropagation(body);
    torch::jit::EliminateDeadCode(body);
    specialized_.emplace(key, body);
    return body;
  }

  void instrument_output(Value* output, const std::string& location, Node* insert_before) {
    if (output->type()->isSubtypeOf(*c10::TensorType::get())) {
      Value* replaced = instrument(output, location, insert_before);
      if (replaced != output) output->replaceAllUsesAfterNodeWith(replaced->node(), replaced);
      return;
    }
    auto tuple = output->type()->cast<c10::TupleType>();
    if (!tuple || tuple->elements().empty() ||
        !tuple->elements()[0]->isSubtypeOf(*c10::TensorType::get()))
      return;
    // (output, output_bias): the main output is the first element.
    WithInsertPoint guard(insert_before);
    Node* unpack = graph_->insertNode(graph_->createTupleUnpack(output));
    propagate_rank_local(unpack);
    Value* main = instrument(unpack->output(0), location, insert_before);
    if (main == unpack->output(0)) {
      for (Value* element : unpack->outputs()) derived_from_.erase(element);
      unpack->destroy();
      return;
    }
    std::vector<Value*> elements(unpack->outputs().begin(), unpack->outputs().end());
    elements[0] = main;
    Node* rebuilt = graph_->insertNode(graph_->createTuple(elements));
    propagate_rank_local(rebuilt);
    output->replaceAllUsesAfterNodeWith(rebuilt, rebuilt->output());
  }

  /// Inserts the ops for `location` on `value` before `insert_before` and
  /// returns the value the model should carry on with (`value` itself where
  /// the location is rank-local and gets no op).
  Value* instrument(Value* value, const std::string& location, Node* insert_before) {
    WithInsertPoint guard(insert_before);
    auto found = rules_.find(location);
    if (const ir::FragmentRule* rule = found == rules_.end() ? nullptr : found->second) {
      Value* loc = graph_->insertConstant(location);
      Value* rule_text = graph_->insertConstant(ir::to_json(*rule).dump());
      Value* whole = insert_op(kGather, {value, loc, rule_text}, value->type());
      Value* edited = insert_op(kIntervene, {whole, loc, graph_->insertConstant(true)}, value->type());
      Value* piece = insert_op(kSplit, {edited, value, loc, rule_text}, value->type());
      // The piece carries on into the model: rank-local from here on (unless
      // one rank holds it all, as a padded vocab at tp_size 1).
      if (rule->group_size > 1) derived_from_[piece] = location;
      return piece;
    }
    if (auto it = derived_from_.find(value); it != derived_from_.end()) {
      table_.rank_local.push_back({location, it->second});
      return value;
    }
    table_.whole.push_back(location);
    Value* loc = graph_->insertConstant(location);
    return insert_op(kIntervene, {value, loc, graph_->insertConstant(false)}, value->type());
  }

  Value* insert_op(c10::Symbol kind, const std::vector<Value*>& inputs, const c10::TypePtr& type) {
    Node* node = graph_->insertNode(graph_->create(kind, inputs, 1));
    node->output()->setType(type);
    return node->output();
  }

  torch::jit::Module& root_;
  ir::FragmentTable& table_;
  const std::string& source_;
  std::shared_ptr<Graph> graph_;
  Value* self_ = nullptr;
  /// Fragment rules by location (from the table).
  std::unordered_map<std::string, const ir::FragmentRule*> rules_;
  /// Specialized callee bodies (see specialize).
  std::unordered_map<std::string, std::shared_ptr<Graph>> specialized_;
  /// Rank-local values and the fragmented location each derives from.
  std::unordered_map<Value*, std::string> derived_from_;
};

}  // namespace

bool has_fragment_ops(const torch::jit::Module& root) {
  auto& function = torch::jit::toGraphFunction(root.get_method("forward").function());
  return any_fragment_op(function.graph()->block());
}

void insert_fragment_ops(torch::jit::Module& root, ir::FragmentTable& table,
                         const std::string& source) {
  FragmentOpInserter(root, table, source).run();
}

}  // namespace frag::passes
