//===- passes/insert_fragment_ops_pt2.cpp - The rewrite of a .pt2 graph ===//
#include "passes/insert_fragment_ops_pt2.h"

#include "ir/error.h"
#include "ir/fragment_rule.h"
#include "ir/module_path.h"
#include "passes/pending_rank_local.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace frag::passes {
namespace {

using nlohmann::json;

// Targets as a .pt2 graph names them ("torch.ops.<namespace>.<op>.<overload>").
constexpr const char* kGatherTarget = "torch.ops.frag.gather.default";
constexpr const char* kInterveneTarget = "torch.ops.frag.intervene.default";
constexpr const char* kSplitTarget = "torch.ops.frag.split.default";
constexpr const char* kAllReduceTarget = "torch.ops.frag.all_reduce.default";
constexpr const char* kAllGatherTarget = "torch.ops.frag.all_gather.default";

bool is_fragment_target(const std::string& target) {
  return target == kGatherTarget || target == kInterveneTarget || target == kSplitTarget;
}

/// The tensor a JSON argument names, or nullptr ({"as_tensor": {"name": …}}).
json* tensor_name(json& argument) {
  if (!argument.is_object()) return nullptr;
  auto found = argument.find("as_tensor");
  if (found == argument.end() || !found->is_object()) return nullptr;
  auto name = found->find("name");
  return name != found->end() && name->is_string() ? &*name : nullptr;
}

/// Calls `f(name)` on every tensor name an argument holds: {"as_tensor": {"name"}}, {"as_tensors":
/// [{"name"}, …]} and whatever nests them (optional tensors, lists of optionals).
template <typename F>
void for_each_tensor(json& argument, const F& f) {
  if (json* name = tensor_name(argument)) {
    f(*name);
    return;
  }
  if (argument.is_object()) {
    if (auto list = argument.find("as_tensors"); list != argument.end() && list->is_array()) {
      for (auto& element : *list)
        if (element.is_object() && element.contains("name") && element.at("name").is_string()) f(element.at("name"));
      return;
    }
    for (auto& [key, value] : argument.items())
      if (value.is_object() || value.is_array()) for_each_tensor(value, f);
  } else if (argument.is_array()) {
    for (auto& element : argument) for_each_tensor(element, f);
  }
}

/// The path of one nn_module_stack entry "key,path,class" ("" for the root or a malformed entry).
std::string stack_entry_path(const std::string& entry) {
  auto parts = ir::split_stack_entry(entry);
  return parts.size() >= 3 ? parts[1] : "";
}

/// "model.layers.0@1" (a second call of one module) -> "model.layers.0".
std::string module_path_of_call(const std::string& fqn) { return fqn.substr(0, fqn.find('@')); }

/// A size or stride: an integer, or a product of symbolic expressions (sympy text) with its hint.
struct SymbolicInt {
  int64_t constant = 1;
  std::vector<std::string> factors;  ///< sympy expressions multiplied in
  int64_t hint = 1;

  json to_json() const {
    if (factors.empty()) return {{"as_int", constant}};
    std::string expr;
    if (constant == 1 && factors.size() == 1) {
      expr = factors[0];
    } else {
      expr = fmt::format("Mul(Integer({})", constant);
      for (const auto& f : factors) expr += ", " + f;
      expr += ")";
    }
    return {{"as_expr", {{"expr_str", expr}, {"hint", {{"as_int", hint}}}}}};
  }
};

SymbolicInt symbolic_int(const json& size, const std::string& source) {
  SymbolicInt out;
  if (size.contains("as_int")) {
    out.constant = size.at("as_int").get<int64_t>();
    out.hint = out.constant;
  } else if (size.contains("as_expr")) {
    const auto& expr = size.at("as_expr");
    out.factors.push_back(expr.at("expr_str").get<std::string>());
    out.hint = expr.contains("hint") && expr.at("hint").contains("as_int") ? expr.at("hint").at("as_int").get<int64_t>()
                                                                          : 1;
  } else {
    fail("{}: a tensor size the pass cannot read: {}", source, size.dump());
  }
  return out;
}

SymbolicInt operator*(const SymbolicInt& a, const SymbolicInt& b) {
  SymbolicInt out = a;
  out.constant *= b.constant;
  out.factors.insert(out.factors.end(), b.factors.begin(), b.factors.end());
  out.hint *= b.hint;
  return out;
}

class Pt2FragmentOpInserter {
 public:
  Pt2FragmentOpInserter(json& model, ir::FragmentTable& table, const std::string& source)
      : graph_(graph_of(model, source)), module_(model.at("graph_module")), table_(table), source_(source) {}

  void run() {
    for (const auto& layer : table_.layers) {
      if (layer.input) rules_[ir::input_location(layer.path)] = &layer.input->rule;
      if (layer.output) rules_[ir::output_location(layer.path)] = &layer.output->rule;
    }
    read_call_signatures();
    for (const auto& [name, value] : graph_.at("tensor_values").items()) names_.insert(name);
    for (const auto& [name, value] : graph_.at("sym_int_values").items()) names_.insert(name);
    for (const auto& input : graph_.at("inputs"))
      if (const json* name = tensor_name(const_cast<json&>(input))) producer_stack_[name->get<std::string>()] = &root_;

    read_classes();
    read_call_spans();
    json original = std::move(graph_.at("nodes"));
    json& nodes = graph_["nodes"] = json::array();
    for (auto& node : original) {
      const std::string target = node.at("target").get<std::string>();
      if (is_fragment_target(target))
        fail("{}: already rewritten (its graph holds {} nodes); rewrite the original export", source_, target);
      const Stack& stack = *stack_of(node);
      for (auto& input : node.at("inputs")) {
        auto& argument = input.at("arg");
        if (argument.contains("as_graph"))
          fail("{}: node '{}' ({}) holds a nested graph; the pass cannot place fragment ops inside one", source_,
               node.value("name", "?"), target);
        for_each_tensor(argument, [&](json& name) { name = route(name.get<std::string>(), stack, nodes); });
      }
      const std::string* origin = nullptr;
      if (target != kAllReduceTarget && target != kAllGatherTarget)  // the model's collectives make whole values
        for (auto& input : node.at("inputs"))
          for_each_tensor(input.at("arg"), [&](json& name) {
            if (origin == nullptr) origin = origin_of(name.get<std::string>());
          });
      for (auto& output : node.at("outputs"))
        for_each_tensor(output, [&](json& name) {
          producer_stack_[name.get<std::string>()] = &stack;
          if (origin != nullptr) origins_of_[name.get<std::string>()] = origin;
        });
      nodes.push_back(std::move(node));
    }
    // The graph's outputs are consumed at the root: every boundary on the way out is crossed.
    for (auto& output : graph_.at("outputs"))
      for_each_tensor(output, [&](json& name) { name = route(name.get<std::string>(), root_, nodes); });
    auto& specs = module_.at("signature").at("output_specs");
    const auto& outputs = graph_.at("outputs");
    if (specs.size() == outputs.size())
      for (size_t i = 0; i < specs.size(); ++i)
        for (auto& [kind, spec] : specs[i].items())
          if (spec.is_object() && spec.contains("arg") && tensor_name(spec.at("arg")) && outputs[i].contains("as_tensor"))
            spec.at("arg") = outputs[i];
    // Listed in the order TorchScript's rewrite meets them (call order), not first use: one export, one list.
    auto order_of = [&](const std::string& location) { return order_.at(location); };
    std::stable_sort(table_.whole.begin(), table_.whole.end(),
                     [&](const auto& a, const auto& b) { return order_of(a) < order_of(b); });
    std::stable_sort(table_.rank_local.begin(), table_.rank_local.end(),
                     [&](const auto& a, const auto& b) { return order_of(a.location) < order_of(b.location); });
    ir::settle_location_lists(table_);
  }

 private:
  struct Call {
    std::string fqn;                       ///< as module_call_graph names it ("m.layers.0", "m.f@1")
    std::optional<std::string> input;      ///< the first input, when a tensor
    std::optional<std::string> output;     ///< the first output, when a tensor
    size_t first_node = 0, last_node = 0;  ///< the span of its nodes in the original graph
  };
  /// The module calls a node runs in, outermost first. Interned (stack_of, prefix): compared and
  /// stored by address, as a graph has a few hundred distinct stacks and thousands of values.
  using Stack = std::vector<const Call*>;

  /// Where TorchScript's rewrite meets a location: a call's input as the call starts (outer calls
  /// first), its output as it ends (inner calls first). (node index, 0 input / 1 output, depth or -depth)
  using CallOrder = std::tuple<size_t, int, int64_t>;

  static json& graph_of(json& model, const std::string& source) {
    try {
      return model.at("graph_module").at("graph");
    } catch (const json::exception&) {
      fail("{}: models/model.json has no graph_module.graph", source);
    }
  }

  void read_call_signatures() {
    size_t preserved = 0, submodules = 0;
    for (const auto& entry : module_.at("module_call_graph")) {
      const std::string fqn = entry.at("fqn").get<std::string>();
      if (fqn.empty()) continue;
      ++submodules;
      const auto& signature = entry.at("signature");
      if (signature.is_null()) continue;
      ++preserved;
      Call call;
      auto first_tensor = [](const json& list) -> std::optional<std::string> {
        if (list.empty()) return std::nullopt;
        json first = list[0];
        const json* name = tensor_name(first);
        return name ? std::make_optional(name->get<std::string>()) : std::nullopt;
      };
      call.fqn = fqn;
      call.input = first_tensor(signature.at("inputs"));
      call.output = first_tensor(signature.at("outputs"));
      calls_[fqn] = std::move(call);
    }
    if (submodules > 0 && preserved == 0)
      fail("{}: module_call_graph keeps no module's call signature: expected an export with every submodule's "
           "signature preserved (fragkit.export.export(..., format=\"export\") does this), found none",
           source_);
  }

  /// The span of each call's nodes (for CallOrder).
  void read_call_spans() {
    std::set<const Call*> seen;
    const auto& nodes = graph_.at("nodes");
    for (size_t n = 0; n < nodes.size(); ++n)
      for (const Call* call : *stack_of(nodes[n])) {
        Call& c = calls_.at(call->fqn);
        if (seen.insert(call).second) c.first_node = n;
        c.last_node = n;
      }
  }

  /// The calls a node runs in: its nn_module_stack paths that are calls with a signature.
  const Stack* stack_of(const json& node) {
    const auto& metadata = node.at("metadata");
    auto found = metadata.find("nn_module_stack");
    if (found == metadata.end() || !found->is_string()) return &root_;
    const std::string& text = found->get_ref<const std::string&>();
    auto [known, fresh] = stacks_by_text_.try_emplace(text, nullptr);
    if (!fresh) return known->second;
    Stack stack;
    size_t start = 0;
    while (start < text.size()) {
      size_t end = text.find(';', start);
      if (end == std::string::npos) end = text.size();
      const std::string path = stack_entry_path(text.substr(start, end - start));
      if (auto call = calls_.find(path); !path.empty() && call != calls_.end()) stack.push_back(&call->second);
      start = end + 1;
    }
    known->second = intern(std::move(stack));
    return known->second;
  }

  const Stack* intern(Stack stack) { return &*stacks_.insert(std::move(stack)).first; }

  const Stack* prefix(const Stack& stack, size_t length) {
    return intern(Stack(stack.begin(), stack.begin() + static_cast<std::ptrdiff_t>(length)));
  }

  /// The value a consumer running in `consumer` sees for `name`: after each boundary between the
  /// producer's calls and the consumer's (leaving, innermost first; entering, outermost first).
  std::string route(const std::string& name, const Stack& consumer, json& nodes) {
    auto produced = producer_stack_.find(name);
    if (produced == producer_stack_.end()) return name;  // not a tensor this pass has seen produced
    const Stack& producer = *produced->second;
    size_t common = 0;
    while (common < producer.size() && common < consumer.size() && producer[common] == consumer[common]) ++common;
    std::string current = name;
    for (size_t i = producer.size(); i-- > common;) {
      const Call& call = *producer[i];
      if (call.output && *call.output == name)
        current = instrument(current, ir::output_location(module_path_of_call(call.fqn)), prefix(producer, i), nodes,
                             {call.last_node, 1, -static_cast<int64_t>(i)});
    }
    for (size_t i = common; i < consumer.size(); ++i) {
      const Call& call = *consumer[i];
      if (call.input && *call.input == name)
        current = instrument(current, ir::input_location(module_path_of_call(call.fqn)), prefix(consumer, i), nodes,
                             {call.first_node, 0, static_cast<int64_t>(i)});
    }
    return current;
  }

  /// The ops for `location` on `value` (once per value and location), appended to `nodes`; returns the
  /// value the model carries on with (`value` itself where the location is rank-local).
  std::string instrument(const std::string& value, const std::string& location, const Stack* site, json& nodes,
                         const CallOrder& order) {
    auto [done, fresh] = instrumented_.try_emplace({value, location});
    if (!fresh) return done->second;
    order_.try_emplace(location, order);
    done->second = instrument_once(value, location, site, nodes);
    return done->second;
  }

  std::string instrument_once(const std::string& value, const std::string& location, const Stack* site,
                              json& nodes) {
    auto found = rules_.find(location);
    if (const ir::FragmentRule* rule = found == rules_.end() ? nullptr : found->second) {
      rank_local_values_.gathered(value, location, table_);
      const std::string& rule_text = rule_text_of(rule);
      const std::string whole = add_node(nodes, kGatherTarget,
                                         {tensor_input("piece", value), string_input("location", location),
                                          string_input("rule", rule_text)},
                                         whole_meta(value, *rule), site, value);
      const std::string edited = add_node(nodes, kInterveneTarget,
                                          {tensor_input("value", whole), string_input("location", location),
                                           bool_input("fragmented", true)},
                                          meta_of(whole), site, value);
      std::string piece = add_node(nodes, kSplitTarget,
                                   {tensor_input("value", edited), tensor_input("piece", value),
                                    string_input("location", location), string_input("rule", rule_text)},
                                   meta_of(value), site, value);
      if (rule->group_size > 1) {  // the piece carries on into the model: rank-local from here on
        origins_of_[piece] = &origin_texts_.emplace_back(location);
        pieces_.emplace(piece, &origin_texts_.back());
      }
      return piece;
    }
    if (const std::string* origin = origin_of(value)) {
      auto piece = pieces_.find(value);
      if (piece == pieces_.end()) rank_local_values_.add(value, table_.rank_local.size());
      table_.rank_local.push_back({location, *origin, piece == pieces_.end() ? "" : *piece->second});
      return value;
    }
    table_.whole.push_back(location);
    return add_node(nodes, kInterveneTarget,
                    {tensor_input("value", value), string_input("location", location), bool_input("fragmented", false)},
                    meta_of(value), site, value);
  }

  static json tensor_input(const char* name, const std::string& value) {
    return {{"name", name}, {"arg", {{"as_tensor", {{"name", value}}}}}, {"kind", 1}};
  }
  static json string_input(const char* name, const std::string& value) {
    return {{"name", name}, {"arg", {{"as_string", value}}}, {"kind", 1}};
  }
  static json bool_input(const char* name, bool value) {
    return {{"name", name}, {"arg", {{"as_bool", value}}}, {"kind", 1}};
  }

  const json& meta_of(const std::string& value) const {
    try {
      return graph_.at("tensor_values").at(value);
    } catch (const json::exception&) {
      fail("{}: the graph names tensor '{}' but its tensor_values has no entry for it", source_, value);
    }
  }

  /// The metadata of the whole a gather of `piece` makes: the whole's shape, contiguous strides.
  json whole_meta(const std::string& piece, const ir::FragmentRule& rule) const {
    json meta = meta_of(piece);
    auto& sizes = meta.at("sizes");
    const auto rank = static_cast<int64_t>(sizes.size());
    const int64_t dim = rule.dim < 0 ? rule.dim + rank : rule.dim;
    if (dim < 0 || dim >= rank || !sizes[static_cast<size_t>(dim)].contains("as_int")) return meta;
    // Only the fragmented dim changes; the others (batch, sequence: symbolic) stand in as 1.
    std::vector<int64_t> piece_shape(static_cast<size_t>(rank), 1);
    piece_shape[static_cast<size_t>(dim)] = sizes[static_cast<size_t>(dim)].at("as_int").get<int64_t>();
    const auto whole = ir::whole_shape(rule, piece_shape);
    sizes[static_cast<size_t>(dim)] = {{"as_int", whole[static_cast<size_t>(dim)]}};
    SymbolicInt stride;
    std::vector<json> strides(sizes.size());
    for (size_t i = sizes.size(); i-- > 0;) {
      strides[i] = stride.to_json();
      stride = stride * symbolic_int(sizes[i], source_);
    }
    meta.at("strides") = strides;
    return meta;
  }

  /// Appends one node with one tensor output (metadata `meta`) and returns the output's name.
  std::string add_node(json& nodes, const char* target, json inputs, const json& meta, const Stack* site,
                       const std::string& about) {
    std::string name = fresh_name(about);
    graph_.at("tensor_values")[name] = meta;
    json metadata = json::object();
    if (std::string stack = stack_text(*site); !stack.empty()) metadata["nn_module_stack"] = std::move(stack);
    nodes.push_back({{"target", target},
                     {"inputs", std::move(inputs)},
                     {"outputs", json::array({{{"as_tensor", {{"name", name}}}}})},
                     {"metadata", std::move(metadata)},
                     {"is_hop_single_tensor_return", nullptr},
                     {"name", name}});
    producer_stack_[name] = site;
    return name;
  }

  /// "frag_<value>", "frag_<value>_1", …: unused by the graph (named after the model's value, not after
  /// the ops already on it).
  std::string fresh_name(std::string about) {
    while (about.rfind("frag_", 0) == 0) about.erase(0, 5);
    std::string name = "frag_" + about;
    for (int k = 1; names_.count(name); ++k) name = fmt::format("frag_{}_{}", about, k);
    names_.insert(name);
    return name;
  }

  /// An nn_module_stack naming `site`'s calls (key and path alike; the class as the graph names it), after
  /// the graph's root entry: torch.export.unflatten places a node by its stack and needs the root first.
  std::string stack_text(const Stack& site) const {
    std::string text = root_entry_;
    for (const Call* call : site) {
      if (!text.empty()) text += ";";
      text += fmt::format("L__self__{},{},{}", call->fqn, call->fqn, class_of_call(call->fqn));
    }
    return text;
  }

  /// The class of every call path some node's nn_module_stack names.
  void read_classes() {
    for (const auto& node : graph_.at("nodes")) {
      const auto& metadata = node.at("metadata");
      auto found = metadata.find("nn_module_stack");
      if (found == metadata.end() || !found->is_string()) continue;
      const std::string& text = found->get_ref<const std::string&>();
      if (!seen_stack_texts_.insert(text).second) continue;
      size_t start = 0;
      while (start < text.size()) {
        size_t end = text.find(';', start);
        if (end == std::string::npos) end = text.size();
        const std::string entry = text.substr(start, end - start);
        const std::string path = stack_entry_path(entry);
        if (!path.empty()) classes_.emplace(path, ir::split_stack_entry(entry).back());
        else if (root_entry_.empty() && entry.rfind("L__self__,", 0) == 0) root_entry_ = entry;
        start = end + 1;
      }
    }
  }

  std::string class_of_call(const std::string& call) const {
    auto found = classes_.find(call);
    return found == classes_.end() ? "" : found->second;
  }

  const std::string* origin_of(const std::string& value) const {
    auto found = origins_of_.find(value);
    return found == origins_of_.end() ? nullptr : found->second;
  }

  const std::string& rule_text_of(const ir::FragmentRule* rule) {
    auto [text, fresh] = rule_texts_.try_emplace(rule);
    if (fresh) text->second = ir::to_json(*rule).dump();
    return text->second;
  }

  json& graph_;
  json& module_;
  ir::FragmentTable& table_;
  const std::string& source_;
  std::unordered_map<std::string, const ir::FragmentRule*> rules_;
  /// Calls with a preserved signature, by fqn (stable addresses: Stack points at them).
  std::map<std::string, Call> calls_;
  std::unordered_set<std::string> names_;
  const Stack root_;
  std::set<Stack> stacks_;  ///< interned (see Stack)
  std::unordered_map<std::string, const Stack*> stacks_by_text_;
  /// The calls each tensor was produced in (graph inputs: the root).
  std::unordered_map<std::string, const Stack*> producer_stack_;
  /// (value, location) -> the value after that location's ops.
  std::map<std::pair<std::string, std::string>, std::string> instrumented_;
  std::unordered_map<std::string, CallOrder> order_;
  /// Rank-local values -> the fragmented location each derives from.
  std::unordered_map<std::string, const std::string*> origins_of_;
  std::deque<std::string> origin_texts_;
  /// Rank-local values not yet seen at a fragmented location -> their entries in table_.rank_local.
  PendingRankLocal<std::string> rank_local_values_;
  /// The pieces splits hand back to the model -> their fragmented location.
  std::unordered_map<std::string, const std::string*> pieces_;
  std::unordered_map<const ir::FragmentRule*, std::string> rule_texts_;
  std::map<std::string, std::string> classes_;
  /// The graph's root entry of nn_module_stack ("L__self__,,<class>"), "" if no node names it.
  std::string root_entry_;
  std::unordered_set<std::string> seen_stack_texts_;
};

}  // namespace

void insert_fragment_ops_pt2(json& model, ir::FragmentTable& table, const std::string& source) {
  try {
    Pt2FragmentOpInserter(model, table, source).run();
  } catch (const json::exception& e) {
    fail("{}: models/model.json is not a graph this pass reads: {}", source, e.what());
  }
}

bool has_fragment_ops_pt2(const json& model) {
  const auto& graph = model.at("graph_module").at("graph");
  for (const auto& node : graph.at("nodes"))
    if (is_fragment_target(node.at("target").get<std::string>())) return true;
  return false;
}

}  // namespace frag::passes
