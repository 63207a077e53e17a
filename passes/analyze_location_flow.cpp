//===- passes/analyze_location_flow.cpp - What each location visit gets ---===//
#include "passes/analyze_location_flow.h"

#include "ir/error.h"
#include "ir/module_path.h"
#include "ir/op_schemas.h"
#include "passes/pending_rank_local.h"

#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>

#include <c10/util/SmallVector.h>

#include <algorithm>
#include <deque>
#include <unordered_map>

namespace frag::passes {
namespace {

using torch::jit::Block;
using torch::jit::Node;
using torch::jit::Value;

const c10::Symbol kAllReduce = c10::Symbol::fromQualString(ir::kAllReduceOp);
const c10::Symbol kAllGather = c10::Symbol::fromQualString(ir::kAllGatherOp);

bool any_fragment_op(const Block* block) {
  for (const Node* node : block->nodes()) {
    if (ir::is_fragment_op(node->kind())) return true;
    for (const Block* inner : node->blocks())
      if (any_fragment_op(inner)) return true;
  }
  return false;
}

/// Walks root.forward as the inlined graph the rewrite builds, one flow value per value of that graph
/// (the ops the rewrite would insert make values too), without building it.
class LocationFlowAnalysis {
 public:
  LocationFlowAnalysis(const torch::jit::Module& root, ir::FragmentTable& table, MethodSpecializer& bodies)
      : root_(root), table_(table), bodies_(bodies) {
    for (const auto& layer : table_.layers) {
      if (layer.input) rules_[ir::input_location(layer.path)] = &layer.input->rule;
      if (layer.output) rules_[ir::output_location(layer.path)] = &layer.output->rule;
    }
  }

  std::vector<LocationVisit> run(const std::string& source) {
    source_ = &source;
    auto& forward = torch::jit::toGraphFunction(root_.get_method("forward").function());
    auto graph = forward.graph();
    caller_ = {&forward, ""};
    Env env(env_size(*graph));
    for (Value* input : graph->inputs()) env[input] = fresh(input->type().get());
    paths_[env[graph->inputs().at(0)]] = {"", root_._ivalue()};
    walk_block(graph->block(), env);
    ir::settle_location_lists(table_);
    return std::move(visits_);
  }

 private:
  /// A value of the inlined graph: its type and the fragmented location it derives from (rank-local
  /// values). 16 bytes: an 80-layer walk makes about 40k of them, and the walk's time follows its memory;
  /// the rarer tuple bookkeeping lives beside them (tuples_, through_).
  struct Flow {
    const c10::Type* type;  ///< owned by the walked graphs, which outlive the walk
    const std::string* origin = nullptr;
  };

  void set_elements(size_t tuple, c10::ArrayRef<size_t> elements) {
    tuples_[tuple] = {elements_.size(), elements.size()};
    elements_.insert(elements_.end(), elements.begin(), elements.end());
  }

  /// A tuple built here: its elements; else none.
  c10::ArrayRef<size_t> elements_of(size_t tuple) const {
    auto found = tuples_.find(tuple);
    if (found == tuples_.end()) return {};
    return c10::ArrayRef<size_t>(elements_).slice(found->second.first, found->second.second);
  }

  /// The tuple element `value` was unpacked or indexed from (a tuple built here), else `value`.
  size_t through(size_t value) const {
    auto found = through_.find(value);
    return found == through_.end() ? value : found->second;
  }
  /// A graph's values -> their flow values, by Value::unique() (dense within one graph: a vector, not a
  /// hash map, since every body is walked once per call site).
  class Env {
   public:
    explicit Env(size_t size) : ids_(size, kUnseen) {}
    size_t& operator[](const Value* value) { return ids_.at(value->unique()); }
    size_t at(const Value* value) const {
      const size_t id = value->unique() < ids_.size() ? ids_[value->unique()] : kUnseen;
      TORCH_INTERNAL_ASSERT(id != kUnseen, "analyze_location_flow: value %", value->debugName(), " not seen yet");
      return id;
    }

   private:
    static constexpr size_t kUnseen = static_cast<size_t>(-1);
    std::vector<size_t> ids_;
  };
  using Ids = c10::SmallVector<size_t, 8>;  // a node's inputs or outputs: no allocation per node

  size_t fresh(const c10::Type* type) {
    flows_.push_back({type});
    return flows_.size() - 1;
  }

  size_t lookup(const Env& env, Value* value) const { return env.at(value); }

  /// One past the largest Value::unique() of `graph` (found once per graph).
  size_t env_size(const torch::jit::Graph& graph) {
    auto [size, fresh] = env_sizes_.try_emplace(&graph, 0);
    if (fresh) size->second = largest_unique(graph.block()) + 1;
    return size->second;
  }

  static size_t largest_unique(const Block* block) {
    size_t largest = 0;
    for (const Value* input : block->inputs()) largest = std::max(largest, input->unique());
    for (const Node* node : block->nodes()) {
      for (const Value* output : node->outputs()) largest = std::max(largest, output->unique());
      for (const Block* inner : node->blocks()) largest = std::max(largest, largest_unique(inner));
    }
    return largest;
  }

  void walk_block(Block* source, Env& env) {
    for (Node* node : source->nodes()) {
      if (node->kind() == c10::prim::CallMethod) {
        walk_call(node, env);
      } else if (node->kind() == c10::prim::CallFunction) {
        walk_function(node, env);
      } else {
        walk_node(node, env);
      }
    }
  }

  void walk_node(Node* node, Env& env) {
    Ids inputs;
    for (Value* input : node->inputs()) inputs.push_back(lookup(env, input));
    Ids outputs;
    for (Value* output : node->outputs()) outputs.push_back(env[output] = fresh(output->type().get()));
    Ids results;  // what inner blocks return
    for (Block* inner : node->blocks()) {
      for (Value* input : inner->inputs()) env[input] = fresh(input->type().get());
      walk_block(inner, env);
      for (Value* output : inner->outputs()) results.push_back(lookup(env, output));
    }
    if (node->kind() == c10::prim::GetAttr) {
      auto parent = paths_.find(inputs[0]);
      if (parent != paths_.end() && node->output()->type()->cast<c10::ClassType>()) {
        const std::string& name = node->s(c10::attr::name);
        const auto& [parent_path, parent_module] = parent->second;
        paths_[outputs[0]] = {ir::child_path(parent_path, name), parent_module->getAttr(name).toObject()};
      }
    } else if (node->kind() == c10::prim::TupleConstruct) {
      set_elements(outputs[0], inputs);
    } else if (node->kind() == c10::prim::TupleUnpack) {
      const auto elements = elements_of(inputs[0]);
      if (elements.size() == outputs.size())
        for (size_t i = 0; i < outputs.size(); ++i) through_[outputs[i]] = elements[i];
    } else if (node->kind() == c10::prim::TupleIndex) {
      const auto elements = elements_of(inputs[0]);
      auto index = torch::jit::toIValue(node->input(1));
      if (!elements.empty() && index && index->isInt() && index->toInt() >= 0 &&
          static_cast<size_t>(index->toInt()) < elements.size())
        through_[outputs[0]] = elements[static_cast<size_t>(index->toInt())];
    }
    if (node->kind() != kAllReduce && node->kind() != kAllGather) propagate(inputs, results, outputs);
  }

  /// Outputs derive from the first input (then inner block result) that derives from a fragment.
  void propagate(c10::ArrayRef<size_t> inputs, c10::ArrayRef<size_t> results, c10::ArrayRef<size_t> outputs) {
    const std::string* origin = nullptr;
    for (size_t input : inputs)
      if (origin == nullptr) origin = flows_[input].origin;
    for (size_t result : results)
      if (origin == nullptr) origin = flows_[result].origin;
    if (origin == nullptr) return;
    for (size_t output : outputs) flows_[output].origin = origin;
  }

  void walk_call(Node* call, Env& env) {
    std::vector<size_t> arguments;
    for (Value* input : call->inputs()) arguments.push_back(lookup(env, input));
    auto path = paths_.find(arguments[0]);
    if (path == paths_.end()) fail("{}: a method call on a module the pass cannot resolve to a path", *source_);
    const std::string module_path = path->second.first;
    const torch::jit::ObjectPtr callee_module = path->second.second;  // an object, not a Module: cheap to copy
    const std::string method = call->s(c10::attr::name);
    auto& callee = torch::jit::toGraphFunction(callee_module->type()->getMethod(method));
    const bool located = !module_path.empty() && method == "forward";
    site_ = caller_.method == nullptr ? std::nullopt : bodies_.call_site(*caller_.method, call);
    if (located && arguments.size() >= 2 && flows_[arguments[1]].type->isSubtypeOf(*c10::TensorType::get()))
      arguments[1] = visit(arguments[1], ir::input_location(module_path));
    auto body = bodies_.method_body(callee, *callee_module);
    Env inner(env_size(*body));
    for (size_t i = 0; i < arguments.size(); ++i) inner[body->inputs()[i]] = arguments[i];
    const Caller outer = caller_;
    caller_ = {&callee, module_path};
    walk_block(body->block(), inner);
    caller_ = outer;
    for (size_t i = 0; i < call->outputs().size(); ++i) env[call->output(i)] = lookup(inner, body->outputs()[i]);
    site_ = caller_.method == nullptr ? std::nullopt : bodies_.call_site(*caller_.method, call);
    if (located && call->outputs().size() == 1)
      env[call->output()] = visit_output(env[call->output()], ir::output_location(module_path));
  }

  void walk_function(Node* call, Env& env) {
    auto function_type = call->input(0)->type()->cast<c10::FunctionType>();
    auto* function = function_type ? torch::jit::tryToGraphFunction(*function_type->function()) : nullptr;
    if (function == nullptr) {  // not a TorchScript function: an ordinary op
      walk_node(call, env);
      return;
    }
    auto body = bodies_.function_body(*function);
    Env inner(env_size(*body));
    for (size_t i = 0; i < body->inputs().size(); ++i) inner[body->inputs()[i]] = lookup(env, call->input(i + 1));
    const Caller outer = caller_;
    caller_ = {nullptr, ""};  // a free function's calls have no place in a method's graph
    walk_block(body->block(), inner);
    caller_ = outer;
    for (size_t i = 0; i < call->outputs().size(); ++i) env[call->output(i)] = lookup(inner, body->outputs()[i]);
  }

  /// A call's output: a tensor, or (output, output_bias) whose first element is the location's value.
  size_t visit_output(size_t output, const std::string& location) {
    const c10::Type* type = flows_[output].type;
    if (type->isSubtypeOf(*c10::TensorType::get())) return visit(output, location);
    const auto* tuple = type->castRaw<c10::TupleType>();
    if (!tuple || tuple->elements().empty() || !tuple->elements()[0]->isSubtypeOf(*c10::TensorType::get()))
      return output;
    // The rewrite unpacks the tuple, instruments the first element and builds the tuple again.
    Ids elements;
    for (const auto& element_type : tuple->elements()) elements.push_back(fresh(element_type.get()));
    const auto built_from = elements_of(output);
    if (built_from.size() == elements.size())
      for (size_t i = 0; i < elements.size(); ++i) through_[elements[i]] = built_from[i];
    propagate({output}, {}, elements);
    const size_t main = visit(elements[0], location);
    if (main == elements[0]) return output;  // rank-local: no op, the tuple stays as it was
    elements[0] = main;
    // The rebuilt tuple's elements have the types of the call's: its type is the call output's.
    const size_t rebuilt = fresh(type);
    set_elements(rebuilt, elements);
    propagate(elements, {}, {rebuilt});
    return rebuilt;
  }

  void record(const std::string& location, VisitKind kind) {
    LocationVisit visit{location, kind};
    if (site_) {
      visit.caller = caller_.method;
      visit.site = *site_;
      visit.caller_path = caller_.path;
    }
    visits_.push_back(std::move(visit));
  }

  /// Decides what `value` gets at `location`; returns the value the model carries on with.
  size_t visit(size_t value, const std::string& location) {
    auto found = rules_.find(location);
    if (const ir::FragmentRule* rule = found == rules_.end() ? nullptr : found->second) {
      // A rank-local location holding this very value (act_fn's output, gathered as down_proj's input):
      // its whole value is read here.
      rank_local_values_.gathered(value, location, table_);
      record(location, VisitKind::kFragmented);
      const size_t piece = fresh(flows_[value].type);
      // The piece carries on into the model: rank-local from here on (unless one rank holds it all, as a
      // padded vocab at tp_size 1).
      if (rule->group_size > 1) {
        flows_[piece].origin = &origins_.emplace_back(location);
        pieces_.emplace(piece, &origins_.back());
      }
      return piece;
    }
    if (const std::string* origin = flows_[value].origin) {
      // The piece a split handed back (act_fn's input): its whole is that split's location. Another value
      // may still be gathered whole later (act_fn's output as down_proj's input).
      auto piece = pieces_.find(through(value));
      if (piece == pieces_.end()) rank_local_values_.add(value, table_.rank_local.size());
      table_.rank_local.push_back({location, *origin, piece == pieces_.end() ? "" : *piece->second});
      record(location, VisitKind::kRankLocal);
      return value;
    }
    table_.whole.push_back(location);
    record(location, VisitKind::kWhole);
    return fresh(flows_[value].type);
  }

  const torch::jit::Module& root_;
  ir::FragmentTable& table_;
  MethodSpecializer& bodies_;
  const std::string* source_ = nullptr;
  std::vector<Flow> flows_;
  std::vector<size_t> elements_;  ///< the elements of built tuples (tuples_)
  std::unordered_map<size_t, std::pair<size_t, size_t>> tuples_;  ///< built tuple -> its elements in elements_
  std::unordered_map<size_t, size_t> through_;  ///< see through()
  std::vector<LocationVisit> visits_;
  /// The method whose body the walk is in, and its self's module path.
  struct Caller {
    torch::jit::GraphFunction* method = nullptr;
    std::string path;
  };
  Caller caller_;
  std::optional<size_t> site_;  ///< the call being visited, in caller_.method's call sites
  std::unordered_map<const torch::jit::Graph*, size_t> env_sizes_;
  /// Fragment rules by location (from the table).
  std::unordered_map<std::string, const ir::FragmentRule*> rules_;
  /// Module paths and modules of the module-typed flow values.
  std::unordered_map<size_t, std::pair<std::string, torch::jit::ObjectPtr>> paths_;
  /// The fragmented locations rank-local values derive from (stable addresses for Flow::origin).
  std::deque<std::string> origins_;
  /// Rank-local values not yet seen at a fragmented location -> their entries in table_.rank_local, whose
  /// whole_at that location becomes.
  PendingRankLocal<size_t> rank_local_values_;
  /// The pieces splits hand back to the model -> their fragmented location.
  std::unordered_map<size_t, const std::string*> pieces_;
};

}  // namespace

bool has_fragment_ops(const torch::jit::Module& root) {
  for (auto* method : method_graphs(root))
    if (any_fragment_op(method->graph()->block())) return true;
  return false;
}

std::vector<LocationVisit> analyze_location_flow(const torch::jit::Module& root, ir::FragmentTable& table,
                                                 MethodSpecializer& bodies, const std::string& source) {
  if (has_fragment_ops(root))
    fail("{}: already rewritten (its methods hold frag:: fragment ops); rewrite the original export", source);
  return LocationFlowAnalysis(root, table, bodies).run(source);
}

}  // namespace frag::passes
