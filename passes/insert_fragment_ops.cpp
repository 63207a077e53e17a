//===- passes/insert_fragment_ops.cpp - Rewrite with gather/intervene/split ===//
#include "passes/insert_fragment_ops.h"

#include "ir/error.h"
#include "ir/module_path.h"
#include "ir/op_schemas.h"
#include "passes/remove_fragment_ops.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/jit_log.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

namespace frag::passes {
namespace {

using torch::jit::Block;
using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;
using torch::jit::WithInsertPoint;

Value* insert_op(Graph& graph, c10::Symbol kind, const std::vector<Value*>& inputs, const c10::TypePtr& type) {
  Node* node = graph.insertNode(graph.create(kind, inputs, 1));
  node->output()->setType(type);
  return node->output();
}

/// The rule of each fragmented location of a table and its JSON text (a frag::split's rule argument),
/// the text made once per rule: for both inserters.
class RuleTexts {
 public:
  explicit RuleTexts(const ir::FragmentTable& table) {
    for (const auto& layer : table.layers) {
      if (layer.input) rules_[ir::input_location(layer.path)] = &layer.input->rule;
      if (layer.output) rules_[ir::output_location(layer.path)] = &layer.output->rule;
    }
  }

  const std::string& at(const std::string& location) {
    const ir::FragmentRule* rule = rules_.at(location);
    auto [text, fresh] = texts_.try_emplace(rule);
    if (fresh) text->second = ir::to_json(*rule).dump();
    return text->second;
  }

 private:
  std::unordered_map<std::string, const ir::FragmentRule*> rules_;
  std::unordered_map<const ir::FragmentRule*, std::string> texts_;
};

/// Inserts at the graph's insertion point what a visit of kind `kind` gets on `value`, with the location
/// `loc` (a str value) and `rule_text` (a rule's JSON text; fragmented only); returns the value the model
/// carries on with.
Value* insert_location_ops(Graph& graph, VisitKind kind, Value* value, Value* loc, const std::string& rule_text) {
  switch (kind) {
    case VisitKind::kRankLocal:
      return value;
    case VisitKind::kWhole:
      return insert_op(graph, ir::kInterveneKind, {value, loc, graph.insertConstant(false)}, value->type());
    case VisitKind::kFragmented: {
      Value* rule = graph.insertConstant(rule_text);
      Value* whole = insert_op(graph, ir::kGatherKind, {value, loc, rule}, value->type());
      Value* edited = insert_op(graph, ir::kInterveneKind, {whole, loc, graph.insertConstant(true)}, value->type());
      return insert_op(graph, ir::kSplitKind, {edited, value, loc, rule}, value->type());
    }
  }
  TORCH_INTERNAL_ASSERT(false, "insert_fragment_ops: unknown visit kind");
}

bool has_call(const Block* block) {
  for (const Node* node : block->nodes()) {
    if (node->kind() == c10::prim::CallMethod) return true;
    for (const Block* inner : node->blocks())
      if (has_call(inner)) return true;
  }
  return false;
}

/// Inlines submodule calls into the root graph and inserts the fragment ops (or, for a file rewritten
/// per class, only inlines: the ops are already in the bodies).
class FragmentOpInserter {
 public:
  FragmentOpInserter(torch::jit::Module& root, const ir::FragmentTable& table,
                     const std::vector<LocationVisit>& visits, MethodSpecializer& bodies, const std::string& source)
      : root_(root), table_(table), visits_(visits), bodies_(bodies), source_(source) {}

  /// Inlining only, of a file rewritten per class: its bodies hold the ops, their locations computed from
  /// each instance's kModulePathAttribute, which the inlining folds into constants.
  static FragmentOpInserter inlining(torch::jit::Module& root, MethodSpecializer& bodies, const std::string& source) {
    static const ir::FragmentTable kNoTable;
    static const std::vector<LocationVisit> kNoVisits;
    FragmentOpInserter inserter(root, kNoTable, kNoVisits, bodies, source);
    inserter.instrument_ = false;
    return inserter;
  }

  void run() {
    auto& function = torch::jit::toGraphFunction(root_.get_method("forward").function());
    graph_ = function.graph();
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
    paths_[graph_->inputs().at(0)] = {"", root_._ivalue()};
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
    if (!instrument_ && fold_location(node, env)) return;
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
        paths_[copy->output()] = {ir::child_path(parent_path, name), parent_module->getAttr(name).toObject()};
      }
    }
  }

  /// In a file rewritten per class, a location is `self.__frag_path__ + ".rel.output"`: with the instance
  /// known here, both fold to constants (the location ops then read as in a rewrite that inlined).
  bool fold_location(Node* node, Env& env) {
    if (node->kind() == c10::prim::GetAttr && node->s(c10::attr::name) == kModulePathAttribute) {
      auto module = paths_.find(lookup(env, node->input(0)));
      if (module == paths_.end()) return false;
      env[node->output()] = string_constant(module->second.first);
      return true;
    }
    if (node->kind() == c10::aten::add && node->output()->type()->kind() == c10::TypeKind::StringType) {
      auto a = torch::jit::toIValue(lookup(env, node->input(0)));
      auto b = torch::jit::toIValue(lookup(env, node->input(1)));
      if (!a || !b || !a->isString() || !b->isString()) return false;
      env[node->output()] = string_constant(a->toStringRef() + b->toStringRef());
      return true;
    }
    return false;
  }

  Value* string_constant(const std::string& text) {
    WithInsertPoint guard(*graph_->block()->nodes().begin());
    return graph_->insertConstant(text);
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
    const torch::jit::ObjectPtr callee_module = path->second.second;  // an object, not a Module: cheap to copy
    auto& callee = torch::jit::toGraphFunction(callee_module->type()->getMethod(method));
    const bool located = instrument_ && !module_path.empty() && method == "forward";
    if (located && arguments.size() >= 2 && arguments[1]->type()->isSubtypeOf(*c10::TensorType::get()))
      arguments[1] = instrument(arguments[1], ir::input_location(module_path), destination);
    auto body = bodies_.method_body(callee, *callee_module);
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
    if (kind == VisitKind::kRankLocal) return value;
    WithInsertPoint guard(destination);
    const std::string& rule = kind == VisitKind::kFragmented ? rule_texts_.at(location) : kNoRule;
    return insert_location_ops(*graph_, kind, value, graph_->insertConstant(location), rule);
  }

  inline static const std::string kNoRule;
  torch::jit::Module& root_;
  bool instrument_ = true;
  const ir::FragmentTable& table_;
  const std::vector<LocationVisit>& visits_;
  size_t next_visit_ = 0;
  MethodSpecializer& bodies_;
  const std::string& source_;
  std::shared_ptr<Graph> graph_;
  /// Module paths and modules of the module-typed values of the rebuilt graph.
  std::unordered_map<Value*, std::pair<std::string, torch::jit::ObjectPtr>> paths_;
  /// Constants of the source graphs (callee bodies) -> their one copy at the top of the root graph.
  std::unordered_map<const Node*, Value*> constants_;
  RuleTexts rule_texts_{table_};
};

/// Inserts the ops into each class's own method graphs, at the call sites where the analysis met them.
class PerClassInserter {
 public:
  PerClassInserter(torch::jit::Module& root, const ir::FragmentTable& table, const std::vector<LocationVisit>& visits,
                   MethodSpecializer& bodies)
      : root_(root), table_(table), visits_(visits), bodies_(bodies) {}

  /// Empty when done; else why the visits do not allow it (nothing changed then).
  std::string run() {
    if (std::string why = place(); !why.empty()) return why;
    // Classes whose methods compute locations from self get the path attribute, on every instance.
    std::unordered_set<const c10::ClassType*> relative;
    for (const auto& [key, placement] : placements_)
      if (!placement.rooted) relative.insert(class_of(std::get<0>(key)));
    for (const c10::ClassType* type : relative)
      const_cast<c10::ClassType*>(type)->addOrCheckAttribute(kModulePathAttribute, c10::StringType::get());
    name_instances(*root_._ivalue(), "", relative);
    for (const auto& [key, placement] : placements_) {
      const auto& [method, site, output] = key;
      Node* call = bodies_.call_sites(*method).at(site);
      if (output) instrument_output(*method, call, placement);
      else instrument_input(*method, call, placement);
    }
    return "";
  }

 private:
  /// What one call site's input or output gets: the same for every visit there.
  struct Placement {
    VisitKind kind;
    bool rooted;           ///< the caller is the root: the location is a constant
    std::string location;  ///< the location (rooted) or its part after the caller's path (".q_proj.output")
    std::string rule;      ///< fragmented: the rule's JSON text
  };
  using Key = std::tuple<torch::jit::GraphFunction*, size_t, bool>;  // method, call site, output side

  std::string place() {
    for (const auto& visit : visits_) {
      if (visit.caller == nullptr) return fmt::format("{} is visited inside a free function", visit.location);
      const bool output = visit.location.size() > 7 && visit.location.compare(visit.location.size() - 7, 7, ".output") == 0;
      Placement placement{visit.kind, visit.caller_path.empty(), visit.location, ""};
      if (!placement.rooted) {
        if (visit.location.rfind(visit.caller_path + ".", 0) != 0)
          return fmt::format("{} is not inside its caller {}", visit.location, visit.caller_path);
        placement.location = visit.location.substr(visit.caller_path.size());
      }
      if (visit.kind == VisitKind::kFragmented) placement.rule = rule_texts_.at(visit.location);
      auto [known, fresh] = placements_.try_emplace(Key{visit.caller, visit.site, output}, placement);
      if (fresh) continue;
      const Placement& other = known->second;
      if (other.kind != placement.kind || other.rooted != placement.rooted || other.location != placement.location ||
          other.rule != placement.rule)
        return fmt::format("instances of one class differ at {} (one call site, two treatments)", visit.location);
    }
    return "";
  }

  const c10::ClassType* class_of(torch::jit::GraphFunction* method) const {
    auto self = method->graph()->inputs().at(0)->type()->cast<c10::ClassType>();
    TORCH_INTERNAL_ASSERT(self, "insert_fragment_ops: a method without a class self");
    return self.get();
  }

  /// Sets kModulePathAttribute on every instance (in `object`'s tree) of the classes in `relative`.
  static void name_instances(c10::ivalue::Object& object, const std::string& path,
                             const std::unordered_set<const c10::ClassType*>& relative) {
    const c10::ClassTypePtr type = object.type();
    if (relative.count(type.get())) object.setAttr(kModulePathAttribute, c10::IValue(path));
    for (size_t i = 0; i < type->numAttributes(); ++i) {
      auto child = type->getAttribute(i)->cast<c10::ClassType>();
      if (!child || !child->is_module()) continue;
      const c10::IValue& value = object.getSlot(i);
      if (value.isObject()) name_instances(*value.toObject(), ir::child_path(path, type->getAttributeName(i)), relative);
    }
  }

  /// The location as a value of `graph`, inserted at its insertion point: a constant in root.forward,
  /// else self._frag_path (read once per graph, at its top) + the rest.
  Value* location_value(Graph& graph, const Placement& placement) {
    if (placement.rooted) return graph.insertConstant(placement.location);
    auto [path, fresh] = paths_.try_emplace(&graph, nullptr);
    if (fresh) {
      Node* read = graph.createGetAttr(graph.inputs().at(0), kModulePathAttribute);
      read->insertBefore(*graph.block()->nodes().begin());
      path->second = read->output();
    }
    Node* add = graph.insertNode(graph.create(c10::aten::add, {path->second, graph.insertConstant(placement.location)}));
    add->output()->setType(c10::StringType::get());
    return add->output();
  }

  void instrument_input(torch::jit::GraphFunction& method, Node* call, const Placement& placement) {
    if (placement.kind == VisitKind::kRankLocal) return;
    Graph& graph = *method.graph();
    WithInsertPoint guard(call);
    call->replaceInput(1, insert_location_ops(graph, placement.kind, call->input(1), location_value(graph, placement),
                                              placement.rule));
  }

  void instrument_output(torch::jit::GraphFunction& method, Node* call, const Placement& placement) {
    if (placement.kind == VisitKind::kRankLocal) return;
    Graph& graph = *method.graph();
    Value* output = call->output();
    std::vector<torch::jit::Use> uses = output->uses();
    WithInsertPoint guard(call->next());
    Value* result = nullptr;
    if (output->type()->isSubtypeOf(*c10::TensorType::get())) {
      result = insert_location_ops(graph, placement.kind, output, location_value(graph, placement), placement.rule);
    } else {  // (output, output_bias): the main output is the first element
      Node* unpack = graph.insertNode(graph.createTupleUnpack(output));
      std::vector<Value*> elements(unpack->outputs().begin(), unpack->outputs().end());
      elements[0] = insert_location_ops(graph, placement.kind, elements[0], location_value(graph, placement),
                                        placement.rule);
      result = graph.insertNode(graph.createTuple(elements))->output();
    }
    for (const auto& use : uses) use.user->replaceInput(use.offset, result);
  }

  torch::jit::Module& root_;
  const ir::FragmentTable& table_;
  const std::vector<LocationVisit>& visits_;
  MethodSpecializer& bodies_;
  RuleTexts rule_texts_{table_};
  std::map<Key, Placement> placements_;
  std::unordered_map<const Graph*, Value*> paths_;  ///< each method graph's read of self._frag_path
};

}  // namespace

bool is_rewritten_per_class(const torch::jit::Module& root) {
  return has_call(torch::jit::toGraphFunction(root.get_method("forward").function()).graph()->block()) &&
         has_fragment_ops(root);
}

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

std::string insert_fragment_ops_per_class(torch::jit::Module& root, ir::FragmentTable& table,
                                          const std::string& source) {
  MethodSpecializer bodies;
  const auto visits = analyze_location_flow(root, table, bodies, source);
  std::string why = PerClassInserter(root, table, visits, bodies).run();
  if (!why.empty()) insert_fragment_ops(root, table, visits, bodies, source);
  return why;
}

void inline_fragment_ops(torch::jit::Module& root, const std::string& source) {
  {
    MethodSpecializer bodies;
    FragmentOpInserter::inlining(root, bodies, source).run();
  }
  // The ops stay only in the inlined forward: a module's own method (an ad-hoc call's) is the export's again.
  auto& forward = torch::jit::toGraphFunction(root.get_method("forward").function());
  for (auto* method : method_graphs(root)) {
    if (method == &forward) continue;
    remove_all_fragment_ops(*method->graph());
    torch::jit::EliminateDeadCode(method->graph());
  }
}

}  // namespace frag::passes
