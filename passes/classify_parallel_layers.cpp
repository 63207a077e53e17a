//===- passes/classify_parallel_layers.cpp - Find what is sharded --------===//
//
// One function per layer kind turns the layer's config into fragment rules,
// following ../shared/reference/fragment-rules.md row by row.
//
//===----------------------------------------------------------------------===//
#include "passes/classify_parallel_layers.h"

#include "ir/error.h"
#include "ir/json_file.h"
#include "ir/module_description.h"
#include "ir/module_path.h"

#include <fmt/ranges.h>

#include <fstream>
#include <numeric>

namespace frag::passes {
namespace {

using ir::FragmentedSide;
using ir::FragmentRule;
using ir::LayerEntry;

const std::vector<std::string> kKnownKinds = {
    "ReplicatedLinear",   "ColumnParallelLinear",   "MergedColumnParallelLinear",
    "QKVParallelLinear",  "RowParallelLinear",      "VocabParallelEmbedding",
    "ParallelLMHead",     "LogitsProcessor",        "FusedMoE",
};

/// Reads one layer's config attributes, with errors that name the layer.
class LayerConfig {
 public:
  LayerConfig(const ir::ModuleDescription& module, const std::string& source, const std::string& class_name)
      : module_(module), source_(source), path_(module.path), class_name_(class_name) {}

  int64_t integer(const char* name) const {
    const auto& value = get(name);
    if (!value.isInt()) wrong_type(name, "int", value);
    return value.toInt();
  }

  bool boolean(const char* name) const {
    const auto& value = get(name);
    if (!value.isBool()) wrong_type(name, "bool", value);
    return value.toBool();
  }

  std::vector<int64_t> integers(const char* name) const {
    const auto& value = get(name);
    if (!value.isIntList()) wrong_type(name, "List[int]", value);
    return value.toIntVector();
  }

  /// Size of a parameter's dim, if the parameter exists.
  std::optional<int64_t> param_size(const char* name, int64_t dim) const {
    auto it = module_.parameter_shapes.find(name);
    if (it == module_.parameter_shapes.end() || static_cast<int64_t>(it->second.size()) <= dim)
      return std::nullopt;
    return it->second[static_cast<size_t>(dim)];
  }

  /// The padded vocabulary of the model's LM head, when it has one: what a
  /// LogitsProcessor's input is sharded by (its own config records no padding).
  std::optional<int64_t> lm_head_padded_vocab() const { return lm_head_padded_vocab_; }
  void set_lm_head_padded_vocab(std::optional<int64_t> padded) { lm_head_padded_vocab_ = padded; }

  [[noreturn]] void inconsistent(const std::string& problem) const {
    fail("{}: {} ({}): {}", source_, path_, class_name_, problem);
  }

  void require(bool ok, const std::string& problem) const {
    if (!ok) inconsistent(problem);
  }

 private:
  const c10::IValue& get(const char* name) const {
    auto it = module_.attributes.find(name);
    if (it == module_.attributes.end())
      fail("{}: {} ({}): missing config attribute '{}'; export the layer with fragkit or keep "
           "vLLM's attribute names",
           source_, path_, class_name_, name);
    return it->second;
  }

  [[noreturn]] void wrong_type(const char* name, const char* expected, const c10::IValue& found) const {
    fail("{}: {} ({}): config attribute '{}' should be {}, found {}", source_, path_, class_name_,
         name, expected, found.tagKind());
  }

  const ir::ModuleDescription& module_;
  const std::string& source_;
  const std::string& path_;
  const std::string& class_name_;
  std::optional<int64_t> lm_head_padded_vocab_;
};

int64_t checked_tp(const LayerConfig& config) {
  const int64_t tp = config.integer("tp_size");
  const int64_t rank = config.integer("tp_rank");
  config.require(tp >= 1, fmt::format("tp_size {} is not positive", tp));
  config.require(rank >= 0 && rank < tp, fmt::format("tp_rank {} is outside [0, {})", rank, tp));
  return tp;
}

void check_divides(const LayerConfig& config, int64_t tp, int64_t value, const char* what) {
  config.require(value % tp == 0, fmt::format("{} = {} is not divisible by tp_size {}", what, value, tp));
}

FragmentedSide side(FragmentRule rule, std::optional<int64_t> whole_width) {
  ir::validate(rule);
  return FragmentedSide{std::move(rule), whole_width};
}

void column_output(const LayerConfig& config, LayerEntry& entry, int64_t tp, FragmentRule rule,
                   int64_t whole_width) {
  const int64_t per_rank = whole_width / tp;
  if (auto rows = config.param_size("weight", 0))
    config.require(*rows == per_rank || entry.kind == "QKVParallelLinear",
                   fmt::format("weight has {} rows, expected {} (output width {} / tp_size {})", *rows,
                               per_rank, whole_width, tp));
  if (tp == 1) {
    entry.notes.push_back("tp_size=1: not sharded");
  } else if (config.boolean("gather_output")) {
    entry.notes.push_back("gather_output=True: the layer gathers its output itself");
  } else {
    entry.output = side(std::move(rule), whole_width);
  }
}

void classify_column(const LayerConfig& config, LayerEntry& entry) {
  const int64_t tp = checked_tp(config);
  const int64_t width = config.integer("output_size");
  check_divides(config, tp, width, "output_size");
  column_output(config, entry, tp, FragmentRule::shard(-1, ir::kTpGroup, tp), width);
}

void classify_merged(const LayerConfig& config, LayerEntry& entry) {
  const int64_t tp = checked_tp(config);
  auto sizes = config.integers("output_sizes");
  config.require(!sizes.empty(), "output_sizes is empty");
  const int64_t width = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  config.require(width == config.integer("output_size"),
                 fmt::format("output_sizes sum to {} but output_size is {}", width,
                             config.integer("output_size")));
  for (auto s : sizes) check_divides(config, tp, s, "an entry of output_sizes");
  // vLLM fuses [gate | up] in its MLPs; other merged layers get neutral names.
  std::vector<std::string> names;
  const std::string suffix = "gate_up_proj";
  const bool gate_up = sizes.size() == 2 &&
                       (entry.path == suffix || (entry.path.size() > suffix.size() &&
                                                 entry.path.compare(entry.path.size() - suffix.size() - 1,
                                                                    suffix.size() + 1, "." + suffix) == 0));
  if (gate_up) names = {"gate", "up"};
  column_output(config, entry, tp, FragmentRule::segments(sizes, names, ir::kTpGroup, tp), width);
}

void classify_qkv(const LayerConfig& config, LayerEntry& entry) {
  const int64_t tp = checked_tp(config);
  const int64_t heads = config.integer("total_num_heads");
  const int64_t kv_heads = config.integer("total_num_kv_heads");
  const int64_t head_size = config.integer("head_size");
  const int64_t v_head_size = config.integer("v_head_size");
  config.require(heads > 0 && kv_heads > 0 && head_size > 0 && v_head_size > 0,
                 "head counts and sizes must be positive");
  config.require(heads % tp == 0,
                 fmt::format("total_num_heads {} is not divisible by tp_size {}", heads, tp));
  config.require(tp >= kv_heads ? tp % kv_heads == 0 : kv_heads % tp == 0,
                 fmt::format("total_num_kv_heads {} neither divides nor is divisible by tp_size {}",
                             kv_heads, tp));
  const int64_t kv_per_rank = tp >= kv_heads ? 1 : kv_heads / tp;
  const int64_t per_rank = heads / tp * head_size + kv_per_rank * (head_size + v_head_size);
  if (auto rows = config.param_size("weight", 0))
    config.require(*rows == per_rank,
                   fmt::format("weight has {} rows, expected {} for {} q / {} kv heads at tp_size {}",
                               *rows, per_rank, heads, kv_heads, tp));
  const int64_t whole = heads * head_size + kv_heads * (head_size + v_head_size);
  column_output(config, entry, tp,
                FragmentRule::qkv(heads, kv_heads, head_size, v_head_size, ir::kTpGroup, tp), whole);
}

void classify_row(const LayerConfig& config, LayerEntry& entry) {
  const int64_t tp = checked_tp(config);
  const int64_t input = config.integer("input_size");
  check_divides(config, tp, input, "input_size");
  if (auto columns = config.param_size("weight", 1))
    config.require(*columns == input / tp,
                   fmt::format("weight has {} columns, expected {} (input_size {} / tp_size {})",
                               *columns, input / tp, input, tp));
  if (tp == 1) {
    entry.notes.push_back("tp_size=1: not sharded");
    return;
  }
  if (config.boolean("input_is_parallel"))
    entry.input = side(FragmentRule::shard(-1, ir::kTpGroup, tp), input);
  else
    entry.notes.push_back("input_is_parallel=False: the layer splits its whole input itself");
  if (config.boolean("reduce_results"))
    entry.notes.push_back("reduce_results=True: the layer all-reduces its output itself");
  else
    entry.output = side(FragmentRule::partial_sum(ir::kTpGroup, tp), config.integer("output_size"));
}

void classify_vocab_embedding(const LayerConfig& config, LayerEntry& entry) {
  checked_tp(config);
  config.integer("num_embeddings_padded");
  entry.notes.push_back("ids in are whole; the layer all-reduces its masked lookup, so its output is whole");
}

void classify_lm_head(const LayerConfig& config, LayerEntry& entry) {
  const int64_t tp = checked_tp(config);
  const int64_t org = config.integer("org_vocab_size");
  const int64_t padded = config.integer("num_embeddings_padded");
  config.require(org <= padded, fmt::format("org_vocab_size {} exceeds num_embeddings_padded {}", org, padded));
  check_divides(config, tp, padded, "num_embeddings_padded");
  if (tp == 1 && padded == org) {
    entry.notes.push_back("tp_size=1 and no vocab padding: whole");
    return;
  }
  // Also at tp_size 1 when padded: the whole logits are the org vocab, so a
  // location reads the same at every tp size.
  entry.output = side(FragmentRule::vocab_shard(org, padded, ir::kTpGroup, tp), org);
}

void classify_logits_processor(const LayerConfig& config, LayerEntry& entry) {
  const int64_t tp = config.integer("tp_size");
  config.require(tp >= 1, fmt::format("tp_size {} is not positive", tp));
  const int64_t org = config.integer("org_vocab_size");
  const int64_t vocab = config.integer("vocab_size");
  // The input is the LM head's output: padded as the head records it (its padding_size need not be
  // vLLM's default 64); without a head in the model, vLLM's default.
  const auto from_head = config.lm_head_padded_vocab();
  const int64_t padded = from_head ? *from_head : FragmentRule::padded_vocab_size(vocab, tp);
  config.require(padded >= org, fmt::format("org_vocab_size {} exceeds the LM head's num_embeddings_padded {}", org,
                                            padded));
  check_divides(config, tp, padded, from_head ? "the LM head's num_embeddings_padded" : "the padded vocab_size");
  if (from_head && padded != FragmentRule::padded_vocab_size(vocab, 1))
    entry.notes.push_back(fmt::format("input padded to {} as the LM head records it", padded));
  if (tp == 1 && padded == org) {
    entry.notes.push_back("tp_size=1 and no vocab padding: whole");
    return;
  }
  entry.input = side(FragmentRule::vocab_shard(org, padded, ir::kTpGroup, tp), org);
  entry.notes.push_back("the layer gathers the vocab shards and drops the padding: its output is whole");
}

void classify_fused_moe(const LayerConfig& config, LayerEntry& entry) {
  const int64_t tp = checked_tp(config);
  const int64_t ep = config.integer("ep_size");
  const int64_t ep_rank = config.integer("ep_rank");
  config.require(ep >= 1 && ep_rank >= 0 && ep_rank < ep,
                 fmt::format("ep_rank {} is outside [0, ep_size {})", ep_rank, ep));
  config.require(tp == 1 || ep == 1,
                 fmt::format("tp_size {} and ep_size {} are both above 1; vLLM shards experts one way", tp, ep));
  check_divides(config, tp, config.integer("intermediate_size"), "intermediate_size");
  const int64_t group = tp * ep;
  if (group == 1) {
    entry.notes.push_back("tp_size=ep_size=1: not sharded");
  } else if (config.boolean("reduce_results")) {
    entry.notes.push_back("reduce_results=True: the layer all-reduces its output itself");
  } else {
    // The partial sum spans the flat expert group: tp_size·ep_size, not tp_size alone.
    entry.output = side(FragmentRule::partial_sum(ir::kTpEpGroup, group), config.integer("hidden_size"));
  }
}

void classify_replicated(const LayerConfig&, LayerEntry& entry) {
  entry.notes.push_back("replicated: every rank holds the whole weight");
}

using Classifier = void (*)(const LayerConfig&, LayerEntry&);

Classifier classifier_for(const std::string& kind) {
  static const std::map<std::string, Classifier> table = {
      {"ReplicatedLinear", classify_replicated},
      {"ColumnParallelLinear", classify_column},
      {"MergedColumnParallelLinear", classify_merged},
      {"QKVParallelLinear", classify_qkv},
      {"RowParallelLinear", classify_row},
      {"VocabParallelEmbedding", classify_vocab_embedding},
      {"ParallelLMHead", classify_lm_head},
      {"LogitsProcessor", classify_logits_processor},
      {"FusedMoE", classify_fused_moe},
  };
  auto it = table.find(kind);
  return it == table.end() ? nullptr : it->second;
}

/// Calls `visit(path, module)` for `module` and every submodule below it, in
/// the order of Module::named_modules (pre-order, slot order). Walks only the
/// module-typed slots: named_modules visits every slot of every module and
/// joins each path anew, which was most of the classification's time.
template <typename Visit>
void walk_modules(const c10::ivalue::Object& object, const std::string& path, const Visit& visit) {
  visit(path, object);
  const auto type = object.type();
  for (size_t i = 0; i < type->numAttributes(); ++i) {
    if (!type->getAttribute(i)->is_module()) continue;
    walk_modules(*object.getSlot(i).toObject(), ir::child_path(path, type->getAttributeName(i)), visit);
  }
}

}  // namespace

const std::vector<std::string>& known_layer_kinds() { return kKnownKinds; }

std::string plain_class_name(const std::string& qualified_name) {
  std::string last;
  size_t start = 0;
  while (start <= qualified_name.size()) {
    size_t end = qualified_name.find('.', start);
    if (end == std::string::npos) end = qualified_name.size();
    std::string part = qualified_name.substr(start, end - start);
    if (part.rfind("___torch_mangle_", 0) != 0) last = part;
    start = end + 1;
  }
  return last;
}

LayerAliases LayerAliases::from_file(const std::string& path) {
  nlohmann::json json = ir::read_json_file(path, "rules file");
  if (!json.is_object() || !json.contains("layers") || !json["layers"].is_object())
    fail("{}: rules file must be an object with \"layers\": {{\"ClassName\": \"KnownKind\", …}}", path);
  LayerAliases aliases;
  aliases.source = path;
  for (const auto& [name, kind] : json["layers"].items()) {
    if (name.empty())
      fail("{}: \"layers\" has an empty class name (declared as {}): expected the Python class name of a layer, "
           "e.g. \"MyRowLinear\"",
           path, kind.dump());
    if (kind.is_string() && kind.get_ref<const std::string&>().empty())
      fail("{}: class '{}' is declared as \"\" (empty): expected one of the known kinds {}", path, name,
           fmt::join(kKnownKinds, ", "));
    if (!kind.is_string() || classifier_for(kind.get<std::string>()) == nullptr)
      fail("{}: class '{}' is declared as unknown kind {}; known kinds: {}", path, name, kind.dump(),
           fmt::join(kKnownKinds, ", "));
    // A known class read as another kind would get another layout: wrong wholes, silently.
    if (classifier_for(name) != nullptr && name != kind.get<std::string>())
      fail("{}: class '{}' is a kind frag knows; a rules file declares new classes only, not '{}' as {}", path,
           name, name, kind.get<std::string>());
    aliases.kind_of_class[name] = kind.get<std::string>();
  }
  return aliases;
}

namespace {

/// The known kind `class_name` is treated as, or "" for a module the pass ignores.
std::string kind_of(const std::string& class_name, const LayerAliases& aliases) {
  auto alias = aliases.kind_of_class.find(class_name);
  const std::string kind = alias != aliases.kind_of_class.end() ? alias->second : class_name;
  return classifier_for(kind) != nullptr ? kind : std::string();
}

/// The one num_embeddings_padded of the model's ParallelLMHead layers (none, or several that differ: nullopt).
std::optional<int64_t> lm_head_padded_vocab(const std::vector<ir::ModuleDescription>& modules,
                                            const LayerAliases& aliases) {
  std::optional<int64_t> padded;
  for (const auto& module : modules) {
    if (kind_of(plain_class_name(module.class_name), aliases) != "ParallelLMHead") continue;
    auto value = module.attributes.find("num_embeddings_padded");
    if (value == module.attributes.end() || !value->second.isInt()) continue;  // reported when classified
    if (padded && *padded != value->second.toInt()) return std::nullopt;
    padded = value->second.toInt();
  }
  return padded;
}

}  // namespace

std::vector<ir::ModuleDescription> describe_modules(const torch::jit::Module& root, const LayerAliases& aliases) {
  std::vector<ir::ModuleDescription> modules;
  walk_modules(*root._ivalue(), "", [&](const std::string& path, const c10::ivalue::Object& module) {
    const std::string class_name = plain_class_name(module.type()->name()->qualifiedName());
    if (kind_of(class_name, aliases).empty()) return;  // only known layers' attributes are read
    ir::ModuleDescription description{path, class_name, {}, {}, true, "module attributes"};
    const auto type = module.type();
    const auto* object = &module;
    for (size_t i = 0; i < type->numAttributes(); ++i) {
      if (type->getAttribute(i)->is_module()) continue;
      const std::string& name = type->getAttributeName(i);
      const c10::IValue& value = object->getSlot(i);
      if (value.isTensor())
        description.parameter_shapes[name] = value.toTensor().sizes().vec();
      else
        description.attributes[name] = value;
    }
    for (size_t i = 0; i < type->numConstants(); ++i)
      description.attributes.emplace(type->getConstantName(i), type->getConstant(i));
    modules.push_back(std::move(description));
  });
  return modules;
}

ir::FragmentTable classify_parallel_layers(const torch::jit::Module& root,
                                           const LayerAliases& aliases, const std::string& source) {
  return classify_parallel_layers(describe_modules(root, aliases), aliases, source);
}

ir::FragmentTable classify_parallel_layers(const std::vector<ir::ModuleDescription>& modules,
                                           const LayerAliases& aliases, const std::string& source) {
  ir::FragmentTable table;
  const auto head_padded = lm_head_padded_vocab(modules, aliases);
  for (const auto& module : modules) {
    const std::string class_name = plain_class_name(module.class_name);
    const std::string kind = kind_of(class_name, aliases);
    if (kind.empty()) continue;
    if (!module.has_config)
      fail("{}: {} ({}): no recorded layer config; expected it in {}, found none (export with "
           "fragkit.export.export(..., format=\"export\"))",
           source, module.path, class_name, module.config_origin);
    Classifier classify = classifier_for(kind);
    LayerEntry entry{module.path, class_name, kind, std::nullopt, std::nullopt, {}};
    // Errors about a class that a rules file declared name that file too.
    const std::string shown = kind == class_name ? class_name
                                                 : fmt::format("{}, declared {} in {}", class_name, kind,
                                                               aliases.source.empty() ? "the rules" : aliases.source);
    LayerConfig config(module, source, shown);
    config.set_lm_head_padded_vocab(head_padded);
    classify(config, entry);
    // The model's tensor-parallel size: every sharded layer spans the same
    // ranks (layers built with tp_size 1 are allowed, as vLLM's disable_tp).
    int64_t group = config.integer("tp_size");
    if (kind == "FusedMoE") group *= config.integer("ep_size");
    if (group > 1) {
      if (table.tp_size > 1 && group != table.tp_size)
        config.inconsistent(fmt::format("spans {} ranks but earlier layers span {}", group, table.tp_size));
      table.tp_size = group;
    }
    table.layers.push_back(std::move(entry));
  }
  return table;
}

void check_tables_agree(const std::vector<std::string>& sources,
                        const std::vector<ir::FragmentTable>& tables) {
  if (sources.size() != tables.size())
    fail("internal: {} sources for {} fragment tables", sources.size(), tables.size());
  auto describe_layer = [](const LayerEntry& layer) {
    auto side = [](const std::optional<FragmentedSide>& s) { return s ? ir::describe(s->rule) : std::string("whole"); };
    return fmt::format("{} ({}): input {}, output {}", layer.path, layer.class_name, side(layer.input),
                       side(layer.output));
  };
  for (size_t r = 1; r < tables.size(); ++r) {
    const auto& a = tables[0];
    const auto& b = tables[r];
    if (a.tp_size != b.tp_size)
      fail("{} and {} disagree: tp_size {} vs {}", sources[0], sources[r], a.tp_size, b.tp_size);
    if (a.layers.size() != b.layers.size())
      fail("{} and {} disagree: {} vs {} parallel layers", sources[0], sources[r], a.layers.size(),
           b.layers.size());
    for (size_t i = 0; i < a.layers.size(); ++i)
      if (!(a.layers[i] == b.layers[i]))
        fail("{} and {} disagree: {} vs {}", sources[0], sources[r], describe_layer(a.layers[i]),
             describe_layer(b.layers[i]));
    if (a.whole != b.whole || a.rank_local.size() != b.rank_local.size())
      fail("{} and {} disagree on which locations are whole or rank-local", sources[0], sources[r]);
  }
}

}  // namespace frag::passes
