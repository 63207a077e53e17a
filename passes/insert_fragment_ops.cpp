//===- passes/insert_fragment_ops.cpp - Rewrite with gather/intervene/split ===//
#include "passes/insert_fragment_ops.h"

#include "ir/error.h"
#include "ir/module_path.h"
#include "ir/op_schemas.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/jit_log.h>

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

/// Inlines submodule calls into the root graph and inserts the fragment ops.
class FragmentOpInserter {
 public:
  FragmentOpInserter(torch::jit::Module& root, const ir::FragmentTable& table,
                     const std::vector<LocationVisit>& visits, MethodSpecializer& bodies, const std::string& source)
      : root_(root), table_(table), visits_(visits), bodies_(bodies), source_(source) {}

  void run() {
    auto& function = torch::jit::toGraphFunction(root_.get_method("forward").function());
    graph_ = function.graph();
    for (const auto& layer : table_.layers) {
      if (layer.input) rules_[ir::input_location(layer.path)] = &layer.input->rule;
      if (layer.output) rules_[ir::output_location(layer.path)] = &layer.output->rule;
    }
    GRAPH_DUMP("before insert_fragment_ops:", graph_);
    // The root graph is rebuilt from a copy of itself, node by node, always
    // appending: inserting into the middle of a large graph renumbers its
    // topological positions again and again, which is quadratic.
    auto original = graph_->copy();
    Block* block = graph_->block();
    block->return_node()->removeAllInputs();
    std::vector<Node*> old_nodes(block->nodes().begin(), block->nodes().end());
    for (auto it = old_nodes.rbegin(); it != old_nodes.rend(); ++it) (*it)->destroy();
    Env env;
    for (size_t i = 0; i < original->inputs().size(); ++i) env[original->inputs()[i]] = graph_->inputs()[i];
    paths_[graph_->inputs().at(0)] = {"", root_};
    emit_block(original->block(), block, env);
    for (Value* output : original->outputs()) block->registerOutput(lookup(env, output));
    TORCH_INTERNAL_ASSERT(next_visit_ == visits_.size(), "insert_fragment_ops: ", visits_.size() - next_visit_,
                          " location visits of the analysis not met");
    GRAPH_DUMP("after insert_fragment_ops:", graph_);
    // Graph::lint is quadratic in LibTorch (nodes × blocks): about a second
    // for 80 layers. The pass tests lint every rewritten graph; set
    // FRAG_LINT=1 to lint here too.
    if (const char* lint = std::getenv("FRAG_LINT"); lint != nullptr && std::string(lint) == "1") graph_->lint();
  }

 private:
  using Env = std::unordered_map<Value*, Value*>;

  Value* lookup(const Env& env, Value* value) const {
    auto it = env.find(value);
    TORCH_INTERNAL_ASSERT(it != env.end(), "insert_fragment_ops: value %", value->debugName(), " not emitted yet");
    return it->second;
  }

  /// Appends the nodes of `source` (of the original graph or a callee body)
  /// to `destination`, inlining calls and instrumenting their boundaries.
  void emit_block(Block* source, Block* destination, Env& env) {
    for (Node* node : source->nodes()) {
      if (node->kind() == c10::prim::CallMethod) {
        emit_call(node, destination, env);
      } else if (node->kind() == c10::prim::CallFunction) {
        emit_function(node, destination, env);
      } else {
        emit_node(node, destination, env);
      }
    }
  }

  /// Copies one ordinary node (and its blocks, recursively).
  void emit_node(Node* node, Block* destination, Env& env) {
    if (node->kind() == c10::prim::Constant) {
      emit_constant(node, env);
      return;
    }
    Node* copy = graph_->createClone(node, [&](Value* v) { return lookup(env, v); }, /*copy_blocks=*/false);
    destination->appendNode(copy);
    for (size_t i = 0; i < node->outputs().size(); ++i) env[node->output(i)] = copy->output(i);
    for (Block* inner : node->blocks()) {
      Block* copied = copy->addBlock();
      for (Value* input : inner->inputs()) env[input] = copied->addInput()->copyMetadata(input);
      emit_block(inner, copied, env);
      for (Value* output : inner->outputs()) copied->registerOutput(lookup(env, output));
    }
    if (copy->kind() == c10::prim::GetAttr) {
      auto parent = paths_.find(copy->input(0));
      if (parent != paths_.end() && copy->output()->type()->cast<c10::ClassType>()) {
        const std::string& name = copy->s(c10::attr::name);
        const auto& [parent_path, parent_module] = parent->second;
        paths_[copy->output()] = {ir::child_path(parent_path, name), parent_module.attr(name).toModule()};
      }
    }
  }

  /// A constant of a callee body is emitted once, at the top of the root
  /// graph, and shared by every copy of that body (the 80 decoder layers
  /// share one specialized body): a quarter of the inlined nodes were
  /// constants, each copied once per layer.
  void emit_constant(Node* node, Env& env) {
    auto [hoisted, fresh] = constants_.try_emplace(node, nullptr);
    if (fresh) {
      Node* copy = graph_->createClone(node, [](Value* v) -> Value* { TORCH_INTERNAL_ASSERT(false); return v; });
      graph_->block()->prependNode(copy);
      hoisted->second = copy->output();
    }
    env[node->output()] = hoisted->second;
  }

  /// Inlines a submodule call: instruments its input, emits the callee's
  /// specialized body (deeper calls first, so rank-local values are known),
  /// then instruments its output.
  void emit_call(Node* call, Block* destination, Env& env) {
    std::vector<Value*> arguments;
    for (Value* input : call->inputs()) arguments.push_back(lookup(env, input));
    auto path = paths_.find(arguments[0]);
    if (path == paths_.end()) fail("{}: a method call on a module the pass cannot resolve to a path", source_);
    const std::string module_path = path->second.first;
    const std::string method = call->s(c10::attr::name);
    const torch::jit::Module callee_module = path->second.second;
    auto& callee = torch::jit::toGraphFunction(callee_module.get_method(method).function());
    const bool located = !module_path.empty() && method == "forward";
    if (located && arguments.size() >= 2 && arguments[1]->type()->isSubtypeOf(*c10::TensorType::get()))
      arguments[1] = instrument(arguments[1], ir::input_location(module_path), destination);
    auto body = bodies_.method_body(callee, callee_module);
    Env inner;
    for (size_t i = 0; i < arguments.size(); ++i) inner[body->inputs()[i]] = arguments[i];
    emit_block(body->block(), destination, inner);
    for (size_t i = 0; i < call->outputs().size(); ++i) env[call->output(i)] = lookup(inner, body->outputs()[i]);
    if (located && call->outputs().size() == 1)
      env[call->output()] = instrument_output(env[call->output()], ir::output_location(module_path), destination);
  }

  /// Inlines a free function (fragkit.distributed's all-reduce, a rotary
  /// helper): the model's collectives must be visible to the rank-local
  /// analysis.
  void emit_function(Node* call, Block* destination, Env& env) {
    auto function_type = call->input(0)->type()->cast<c10::FunctionType>();
    auto* function = function_type ? torch::jit::tryToGraphFunction(*function_type->function()) : nullptr;
    if (function == nullptr) {  // not a TorchScript function: an ordinary op
      emit_node(call, destination, env);
      return;
    }
    auto body = bodies_.function_body(*function);
    Env inner;
    for (size_t i = 0; i < body->inputs().size(); ++i) inner[body->inputs()[i]] = lookup(env, call->input(i + 1));
    emit_block(body->block(), destination, inner);
    for (size_t i = 0; i < call->outputs().size(); ++i) env[call->output(i)] = lookup(inner, body->outputs()[i]);
  }

  /// Instruments a call's output and returns the value its users get.
  Value* instrument_output(Value* output, const std::string& location, Block* destination) {
    if (output->type()->isSubtypeOf(*c10::TensorType::get())) return instrument(output, location, destination);
    auto tuple = output->type()->cast<c10::TupleType>();
    if (!tuple || tuple->elements().empty() || !tuple->elements()[0]->isSubtypeOf(*c10::TensorType::get()))
      return output;
    // (output, output_bias): the main output is the first element.
    if (next_visit(location).kind == VisitKind::kRankLocal) {
      ++next_visit_;
      return output;
    }
    WithInsertPoint guard(destination);
    Node* unpack = graph_->insertNode(graph_->createTupleUnpack(output));
    std::vector<Value*> elements(unpack->outputs().begin(), unpack->outputs().end());
    elements[0] = instrument(unpack->output(0), location, destination);
    return graph_->insertNode(graph_->createTuple(elements))->output();
  }

  /// The analysis's decision for the next visit, which must be of `location`.
  const LocationVisit& next_visit(const std::string& location) const {
    TORCH_INTERNAL_ASSERT(next_visit_ < visits_.size() && visits_[next_visit_].location == location,
                          "insert_fragment_ops: the walk met ", location, " where the analysis had ",
                          next_visit_ < visits_.size() ? visits_[next_visit_].location : "no more visits");
    return visits_[next_visit_];
  }

  /// Appends the ops for `location` on `value` to `destination` and returns the value the model should
  /// carry on with (`value` itself where the location is rank-local and gets no op).
  Value* instrument(Value* value, const std::string& location, Block* destination) {
    const VisitKind kind = next_visit(location).kind;
    ++next_visit_;
    WithInsertPoint guard(destination);
    switch (kind) {
      case VisitKind::kRankLocal:
        return value;
      case VisitKind::kWhole:
        return insert_op(kIntervene, {value, graph_->insertConstant(location), graph_->insertConstant(false)},
                         value->type());
      case VisitKind::kFragmented: {
        const ir::FragmentRule* rule = rules_.at(location);
        Value* loc = graph_->insertConstant(location);
        Value* rule_text = graph_->insertConstant(rule_text_of(rule));
        Value* whole = insert_op(kGather, {value, loc, rule_text}, value->type());
        Value* edited = insert_op(kIntervene, {whole, loc, graph_->insertConstant(true)}, value->type());
        return insert_op(kSplit, {edited, value, loc, rule_text}, value->type());
      }
    }
    TORCH_INTERNAL_ASSERT(false, "insert_fragment_ops: unknown visit kind");
  }

  /// A rule's JSON text, made once per rule.
  const std::string& rule_text_of(const ir::FragmentRule* rule) {
    auto [text, fresh] = rule_texts_.try_emplace(rule);
    if (fresh) text->second = ir::to_json(*rule).dump();
    return text->second;
  }

  Value* insert_op(c10::Symbol kind, const std::vector<Value*>& inputs, const c10::TypePtr& type) {
    Node* node = graph_->insertNode(graph_->create(kind, inputs, 1));
    node->output()->setType(type);
    return node->output();
  }

  torch::jit::Module& root_;
  const ir::FragmentTable& table_;
  const std::vector<LocationVisit>& visits_;
  size_t next_visit_ = 0;
  MethodSpecializer& bodies_;
  const std::string& source_;
  std::shared_ptr<Graph> graph_;
  /// Module paths and modules of the module-typed values of the rebuilt graph.
  std::unordered_map<Value*, std::pair<std::string, torch::jit::Module>> paths_;
  /// Fragment rules by location (from the table).
  std::unordered_map<std::string, const ir::FragmentRule*> rules_;
  /// Constants of the source graphs (callee bodies) -> their one copy at the top of the root graph.
  std::unordered_map<const Node*, Value*> constants_;
  /// Rule texts by rule (see rule_text_of).
  std::unordered_map<const ir::FragmentRule*, std::string> rule_texts_;
};

}  // namespace

void insert_fragment_ops(torch::jit::Module& root, ir::FragmentTable& table, const std::string& source) {
  MethodSpecializer bodies;
  const auto visits = analyze_location_flow(root, table, bodies, source);
  insert_fragment_ops(root, table, visits, bodies, source);
}

void insert_fragment_ops(torch::jit::Module& root, const ir::FragmentTable& table,
                         const std::vector<LocationVisit>& visits, MethodSpecializer& bodies,
                         const std::string& source) {
  FragmentOpInserter(root, table, visits, bodies, source).run();
}

}  // namespace frag::passes
