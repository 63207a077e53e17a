//===- passes/insert_fragment_ops.cpp - Rewrite with gather/intervene/split ===//
#include "passes/insert_fragment_ops.h"

#include "ir/error.h"
#include "ir/op_schemas.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/jit_log.h>
#include <torch/csrc/jit/passes/constant_propagation.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
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

/// Clears the debug names of a callee body's values before it is copied into
/// the root graph once per call site. With names, every copy collides with
/// the last: Value::setDebugName renames the earlier owner ("x.1", "x.2",
/// ...), and LibTorch's code printer (Module::save) probes candidate after
/// candidate for a free name (PythonPrintImpl::genNameImpl), which made
/// saving superlinear in the number of layers.
void clear_debug_names(Block* block) {
  for (Value* input : block->inputs()) input->setDebugName("");
  for (Node* node : block->nodes()) {
    for (Value* output : node->outputs()) output->setDebugName("");
    for (Block* inner : node->blocks()) clear_debug_names(inner);
  }
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
    ir::settle_location_lists(table_);
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
        paths_[copy->output()] = {join_path(parent_path, name), parent_module.attr(name).toModule()};
      }
    }
    propagate_rank_local(copy);
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
    auto body = specialize(callee, callee_module);
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
    auto& body = function_bodies_[function];
    if (!body) {  // a copy without debug names (see clear_debug_names), once per function
      body = function->graph()->copy();
      clear_debug_names(body->block());
    }
    Env inner;
    for (size_t i = 0; i < body->inputs().size(); ++i) inner[body->inputs()[i]] = lookup(env, call->input(i + 1));
    emit_block(body->block(), destination, inner);
    for (size_t i = 0; i < call->outputs().size(); ++i) env[call->output(i)] = lookup(inner, body->outputs()[i]);
  }

  /// Marks a node's outputs rank-local when any input (or inner block result) is.
  /// The model's own collectives make whole values.
  void propagate_rank_local(Node* node) {
    if (node->kind() == kAllReduce || node->kind() == kAllGather) return;
    const std::string* source = nullptr;
    for (Value* input : node->inputs())
      if (source == nullptr) source = origin_of(input);
    for (Block* inner : node->blocks())
      for (Value* result : inner->outputs())
        if (source == nullptr) source = origin_of(result);
    if (source == nullptr) return;
    for (Value* output : node->outputs()) set_origin(output, source);
  }

  /// The fragmented location a value of the rebuilt graph derives from, or nullptr.
  const std::string* origin_of(const Value* value) const {
    return value->unique() < derived_from_.size() ? derived_from_[value->unique()] : nullptr;
  }

  void set_origin(const Value* value, const std::string* origin) {
    if (value->unique() >= derived_from_.size()) derived_from_.resize(2 * value->unique() + 64, nullptr);
    derived_from_[value->unique()] = origin;
  }

  /// Instances of one class with equal folded config (the 80 decoder layers
  /// of one file) share one specialized body. What is folded is every bool,
  /// int, float, str or None attribute the method reads from self; which
  /// attributes it reads is found once per method (see Specializations).
  std::shared_ptr<Graph> specialize(torch::jit::GraphFunction& callee, const torch::jit::Module& instance) {
    Specializations& known = specializations_[&callee];
    if (!known.scanned) {
      known.scanned = true;
      for (const auto& use : callee.graph()->inputs().at(0)->uses()) {
        if (use.user->kind() != c10::prim::GetAttr) continue;
        const std::string& name = use.user->s(c10::attr::name);
        if (instance.type()->hasAttribute(name))
          known.reads.push_back({name, instance.type()->getAttributeSlot(name), {}});
        else if (instance.type()->hasConstant(name))
          known.reads.push_back({name, std::nullopt, instance.type()->getConstant(name)});
      }
    }
    // The folded values of this instance (nullopt: that attribute is not folded).
    std::vector<std::optional<c10::IValue>> values;
    values.reserve(known.reads.size());
    for (const auto& read : known.reads) {
      c10::IValue value = read.slot ? instance._ivalue()->getSlot(*read.slot) : read.constant;
      values.push_back(foldable(value) ? std::make_optional(std::move(value)) : std::nullopt);
    }
    for (const auto& [folded, body] : known.bodies)
      if (same_values(folded, values)) return body;
    auto body = callee.graph()->copy();
    Value* self = body->inputs().at(0);
    std::vector<Node*> reads;
    for (const auto& use : self->uses())
      if (use.user->kind() == c10::prim::GetAttr) reads.push_back(use.user);
    bool folded_any = false;
    for (Node* read : reads) {
      const std::string name = read->s(c10::attr::name);
      auto found = std::find_if(known.reads.begin(), known.reads.end(), [&](const auto& r) { return r.name == name; });
      if (found == known.reads.end()) continue;
      const auto& value = values[found - known.reads.begin()];
      if (!value) continue;
      WithInsertPoint guard(read);
      read->output()->replaceAllUsesWith(body->insertConstant(*value));
      read->destroy();
      folded_any = true;
    }
    // Nothing folded, nothing to propagate (the compiler already propagated
    // the method's own constants). Skipped because ConstantPropagation's
    // alias analysis walks the module types of a body that holds every layer
    // (the model's forward): a fifth of the rewrite's time.
    if (folded_any) {
      torch::jit::ConstantPropagation(body);
      torch::jit::EliminateDeadCode(body);
    }
    clear_debug_names(body->block());
    known.bodies.emplace_back(std::move(values), body);
    return body;
  }

  static bool foldable(const c10::IValue& value) {
    return value.isBool() || value.isInt() || value.isDouble() || value.isString() || value.isNone();
  }

  /// Equal folded configs: same kinds and values (floats bit for bit).
  static bool same_values(const std::vector<std::optional<c10::IValue>>& a,
                          const std::vector<std::optional<c10::IValue>>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i].has_value() != b[i].has_value()) return false;
      if (!a[i]) continue;
      const c10::IValue& x = *a[i];
      const c10::IValue& y = *b[i];
      if (x.tagKind() != y.tagKind()) return false;
      if (x.isDouble()) {
        // Bit patterns, not values: NaN equals itself and 0.0 differs from -0.0 (a config is data).
        const double dx = x.toDouble(), dy = y.toDouble();
        uint64_t bx = 0, by = 0;
        std::memcpy(&bx, &dx, sizeof dx);
        std::memcpy(&by, &dy, sizeof dy);
        if (bx != by) return false;
      } else if (x.isString()) {
        if (x.toStringRef() != y.toStringRef()) return false;
      } else if (x.isInt()) {
        if (x.toInt() != y.toInt()) return false;
      } else if (x.isBool()) {
        if (x.toBool() != y.toBool()) return false;
      }
    }
    return true;
  }

  /// Instruments a call's output and returns the value its users get.
  Value* instrument_output(Value* output, const std::string& location, Block* destination) {
    if (output->type()->isSubtypeOf(*c10::TensorType::get())) return instrument(output, location, destination);
    auto tuple = output->type()->cast<c10::TupleType>();
    if (!tuple || tuple->elements().empty() || !tuple->elements()[0]->isSubtypeOf(*c10::TensorType::get()))
      return output;
    // (output, output_bias): the main output is the first element.
    WithInsertPoint guard(destination);
    Node* unpack = graph_->insertNode(graph_->createTupleUnpack(output));
    propagate_rank_local(unpack);
    Value* main = instrument(unpack->output(0), location, destination);
    if (main == unpack->output(0)) {
      for (Value* element : unpack->outputs()) set_origin(element, nullptr);
      unpack->destroy();
      return output;
    }
    std::vector<Value*> elements(unpack->outputs().begin(), unpack->outputs().end());
    elements[0] = main;
    Node* rebuilt = graph_->insertNode(graph_->createTuple(elements));
    propagate_rank_local(rebuilt);
    return rebuilt->output();
  }

  /// Appends the ops for `location` on `value` to `destination` and
  /// returns the value the model should carry on with (`value` itself where
  /// the location is rank-local and gets no op).
  Value* instrument(Value* value, const std::string& location, Block* destination) {
    WithInsertPoint guard(destination);
    auto found = rules_.find(location);
    if (const ir::FragmentRule* rule = found == rules_.end() ? nullptr : found->second) {
      // A rank-local location holding this very value (act_fn's output, gathered as down_proj's input):
      // its whole value is read here.
      if (auto pending = rank_local_values_.find(value->unique()); pending != rank_local_values_.end()) {
        for (const size_t index : pending->second)
          if (table_.rank_local[index].whole_at.empty()) table_.rank_local[index].whole_at = location;
        rank_local_values_.erase(pending);
      }
      Value* loc = graph_->insertConstant(location);
      Value* rule_text = graph_->insertConstant(rule_text_of(rule));
      Value* whole = insert_op(kGather, {value, loc, rule_text}, value->type());
      Value* edited = insert_op(kIntervene, {whole, loc, graph_->insertConstant(true)}, value->type());
      Value* piece = insert_op(kSplit, {edited, value, loc, rule_text}, value->type());
      // The piece carries on into the model: rank-local from here on (unless
      // one rank holds it all, as a padded vocab at tp_size 1).
      if (rule->group_size > 1) {
        set_origin(piece, &origins_.emplace_back(location));
        pieces_.emplace(piece->unique(), &origins_.back());
      }
      return piece;
    }
    if (const std::string* origin = origin_of(value)) {
      // The piece a split handed back (act_fn's input): its whole is that split's location. Another value
      // may still be gathered whole later (act_fn's output as down_proj's input).
      auto piece = pieces_.find(through_tuples(value)->unique());
      if (piece == pieces_.end()) rank_local_values_[value->unique()].push_back(table_.rank_local.size());
      table_.rank_local.push_back({location, *origin, piece == pieces_.end() ? "" : *piece->second});
      return value;
    }
    table_.whole.push_back(location);
    Value* loc = graph_->insertConstant(location);
    return insert_op(kIntervene, {value, loc, graph_->insertConstant(false)}, value->type());
  }

  /// The tuple element `value` reads where it unpacks or indexes a tuple built in this graph (a linear
  /// layer's rebuilt (output, bias)); else `value`.
  static Value* through_tuples(Value* value) {
    Node* node = value->node();
    if (node->kind() == c10::prim::TupleUnpack && node->input()->node()->kind() == c10::prim::TupleConstruct)
      return node->input()->node()->input(value->offset());
    if (node->kind() == c10::prim::TupleIndex && node->input(0)->node()->kind() == c10::prim::TupleConstruct) {
      auto index = torch::jit::toIValue(node->input(1));
      Node* tuple = node->input(0)->node();
      if (index && index->isInt() && index->toInt() >= 0 && static_cast<size_t>(index->toInt()) < tuple->inputs().size())
        return tuple->input(static_cast<size_t>(index->toInt()));
    }
    return value;
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
  ir::FragmentTable& table_;
  const std::string& source_;
  std::shared_ptr<Graph> graph_;
  /// Module paths and modules of the module-typed values of the rebuilt graph.
  std::unordered_map<Value*, std::pair<std::string, torch::jit::Module>> paths_;
  /// Fragment rules by location (from the table).
  std::unordered_map<std::string, const ir::FragmentRule*> rules_;
  /// What a method reads from self, and its specialized bodies (see specialize).
  struct Specializations {
    struct Read {
      std::string name;
      std::optional<size_t> slot;  ///< the attribute's slot; none for a class constant
      c10::IValue constant;
    };
    bool scanned = false;
    std::vector<Read> reads;
    std::vector<std::pair<std::vector<std::optional<c10::IValue>>, std::shared_ptr<Graph>>> bodies;
  };
  std::unordered_map<const torch::jit::GraphFunction*, Specializations> specializations_;
  /// Constants of the source graphs (callee bodies) -> their one copy at the top of the root graph.
  std::unordered_map<const Node*, Value*> constants_;
  /// Rule texts by rule (see rule_text_of).
  std::unordered_map<const ir::FragmentRule*, std::string> rule_texts_;
  /// The fragmented locations rank-local values derive from (stable addresses for derived_from_).
  std::deque<std::string> origins_;
  /// Free functions' bodies without debug names (see emit_function).
  std::unordered_map<const torch::jit::GraphFunction*, std::shared_ptr<Graph>> function_bodies_;
  /// Rank-local values and the fragmented location each derives from.
  /// (By Value::unique(), dense in one graph: a lookup per input of every node.)
  std::vector<const std::string*> derived_from_;
  /// Rank-local values not yet seen at a fragmented location (by Value::unique()) -> their entries in
  /// table_.rank_local, whose whole_at that location becomes.
  std::unordered_map<size_t, std::vector<size_t>> rank_local_values_;
  /// The pieces splits hand back to the model (by Value::unique()) -> their fragmented location.
  std::unordered_map<size_t, const std::string*> pieces_;
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
