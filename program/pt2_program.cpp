//===- program/pt2_program.cpp - A .pt2 rank file made ready for torch.export ===//
#include "program/pt2_program.h"

#include "ir/error.h"
#include "passes/insert_fragment_ops_pt2.h"
#include "passes/rewrite_for_fragments.h"
#include "runtime/pt2_archive.h"

#include <fmt/format.h>

#include <optional>
#include <set>

namespace frag::program {
namespace {

/// torch/_export/serde/schema.py's ScalarType codes of the floating-point types.
std::optional<at::ScalarType> floating_type(int64_t code) {
  switch (code) {
    case 6: return at::kHalf;
    case 7: return at::kFloat;
    case 8: return at::kDouble;
    case 13: return at::kBFloat16;
    default: return std::nullopt;
  }
}

at::ScalarType parameters_dtype(const nlohmann::json& model) {
  const auto& graph = model.at("graph_module").at("graph");
  for (const auto& spec : model.at("graph_module").at("signature").at("input_specs")) {
    if (!spec.contains("parameter")) continue;
    const auto& value = graph.at("tensor_values").find(spec.at("parameter").at("arg").at("name").get<std::string>());
    if (value == graph.at("tensor_values").end()) continue;
    if (auto type = floating_type(value->value("dtype", 0))) return *type;
  }
  return at::kFloat;
}

}  // namespace

PreparedPt2 prepare_pt2_rank(runtime::RankContext& context, const std::string& path,
                                     const std::string& rules_file) {
  PreparedPt2 prepared;
  runtime::ExportedProgram program;
  std::string error;
  try {
    program = runtime::read_exported_program(path);
  } catch (const Error& e) {
    error = e.what();
  }
  runtime::check_export_across_ranks(context, path, program.info, error);
  try {
    ir::FragmentTable table;
    if (!program.rule_table.empty()) {
      nlohmann::json json;
      try {
        json = nlohmann::json::parse(program.rule_table);
      } catch (const nlohmann::json::exception& e) {
        fail("{}: its fragment table (extra/{}) is not valid JSON: {}", path, runtime::kRuleTableFile, e.what());
      }
      table = ir::table_from_json(json, path);
    } else {
      if (passes::has_fragment_ops_pt2(program.model))
        fail("{}: its graph holds fragment ops but no fragment table: give the original export or frag "
             "rewrite's output",
             path);
      auto aliases = rules_file.empty() ? passes::LayerAliases{} : passes::LayerAliases::from_file(rules_file);
      table = passes::rewrite_pt2_for_fragments(program.model, program.modules, aliases, path);
      prepared.rewritten_here = true;
    }
    prepared.locations = std::make_shared<const ir::LocationTable>(std::move(table));
    prepared.dtype = parameters_dtype(program.model);
    prepared.model = std::move(program.model);
    prepared.kv_cache = program.kv_cache;
  } catch (const Error& e) {
    error = e.what();
  } catch (const nlohmann::json::exception& e) {
    error = fmt::format("{}: its graph (models/model.json) is not as torch.export writes it: {}", path, e.what());
  }
  context.agree("rewrite", error);
  // Containers that run no node of their own (a ModuleList) are named by no stack: add every missing parent.
  std::set<std::string> named;
  for (const auto& module : program.modules) named.insert(module.path);
  if (!named.count("")) prepared.modules.emplace_back("", "");
  for (const auto& module : program.modules) {
    for (size_t dot = module.path.find('.'); dot != std::string::npos; dot = module.path.find('.', dot + 1))
      if (named.insert(module.path.substr(0, dot)).second) prepared.modules.emplace_back(module.path.substr(0, dot), "");
    prepared.modules.emplace_back(module.path, module.class_name);
    auto& integers = prepared.attributes[module.path];
    for (const auto& [name, value] : module.attributes)
      if (value.isInt()) integers[name] = value.toInt();
  }
  return prepared;
}

Pt2Program::Pt2Program(const std::string& path, PreparedPt2& prepared)
    : RankProgram(path, prepared.locations),
      modules_(std::move(prepared.modules)),
      attributes_(std::move(prepared.attributes)),
      dtype_(prepared.dtype),
      kv_cache_(prepared.kv_cache) {}

std::vector<int64_t> Pt2Program::kv_cache_shape(int64_t max_batch, int64_t max_len) const {
  if (!kv_cache_) return {};
  return {kv_cache_->layers, 2, max_batch, kv_cache_->kv_heads, max_len, kv_cache_->head_size};
}

torch::Tensor Pt2Program::forward(const torch::Tensor& input_ids, const std::vector<ir::LocationId>* kept,
                                           Use use) {
  if (!kv_cache_) return run_graph(input_ids, nullptr, kept, use);
  // A cached program's plain forward: the sequence's own positions into a scratch cache of its length.
  const int64_t rows = input_ids.size(0), tokens = input_ids.size(1);
  CachedStep scratch;
  auto options = torch::TensorOptions().device(device());
  scratch.positions = torch::arange(tokens, options.dtype(torch::kLong)).unsqueeze(0).expand({rows, tokens});
  scratch.kv_cache = torch::zeros(kv_cache_shape(rows, tokens), options.dtype(dtype_));
  scratch.cache_len = tokens;
  return run_graph(input_ids, &scratch, kept, use);
}

torch::Tensor Pt2Program::forward_cached(const torch::Tensor& input_ids, const CachedStep& step,
                                                  const std::vector<ir::LocationId>* kept) {
  // The program attends over the cache it is given (its cache_len is the constant 0): the span travels as
  // a view of the cache's first cache_len slots, and the new k/v land in the cache through it.
  CachedStep narrowed = step;
  narrowed.kv_cache = step.kv_cache.narrow(4, 0, step.cache_len);
  return run_graph(input_ids, &narrowed, kept, Use::kRepeated);
}

std::map<std::string, int64_t> Pt2Program::int_attributes(const std::string& path) const {
  auto found = attributes_.find(path);
  return found == attributes_.end() ? std::map<std::string, int64_t>{} : found->second;
}

}  // namespace frag::program
