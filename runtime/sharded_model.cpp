//===- runtime/sharded_model.cpp - The C++ API: one rank of a sharded model ===//
#include "runtime/sharded_model.h"

#include "ir/error.h"
#include "passes/insert_fragment_ops.h"
#include "passes/rewrite_for_fragments.h"

#include <fmt/ranges.h>

#include <algorithm>

namespace frag::runtime {
namespace {

/// FNV-1a: a digest for comparing texts across ranks (not for security).
uint64_t digest(const std::string& text) {
  uint64_t hash = 1469598103934665603ull;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return hash;
}

at::ScalarType model_dtype(const torch::jit::Module& module) {
  for (const auto& p : module.parameters())
    if (p.is_floating_point()) return p.scalar_type();
  return at::kFloat;
}

}  // namespace

ShardedModel ShardedModel::load(std::shared_ptr<RankContext> context, const std::string& path,
                                const torch::Device& device, const std::string& rules_file) {
  ShardedModel model;
  model.context_ = std::move(context);
  model.rank_ = load_and_check_rank_module(*model.context_, path, device);
  auto& extra = model.rank_.extra_files;
  std::string error;
  try {
    if (auto it = extra.find(kRuleTableFile); it != extra.end()) {
      model.table_ = ir::table_from_json(nlohmann::json::parse(it->second), path);
    } else {
      auto aliases = rules_file.empty() ? passes::LayerAliases{} : passes::LayerAliases::from_file(rules_file);
      model.table_ = passes::rewrite_for_fragments(model.rank_.module, aliases, path);
    }
  } catch (const Error& e) {
    error = e.what();
  }
  model.context_->agree("rewrite", error);
  return model;
}

LocationKind ShardedModel::kind_of(const std::string& location) const {
  if (table_.rule_at(location) != nullptr) return LocationKind::kFragmented;
  if (std::find(table_.whole.begin(), table_.whole.end(), location) != table_.whole.end())
    return LocationKind::kWhole;
  for (const auto& local : table_.rank_local)
    if (local.location == location) return LocationKind::kRankLocal;
  return LocationKind::kUnknown;
}

void ShardedModel::check_location(const std::string& location, const std::string& what) const {
  switch (kind_of(location)) {
    case LocationKind::kFragmented:
    case LocationKind::kWhole:
      return;
    case LocationKind::kRankLocal:
      for (const auto& local : table_.rank_local)
        if (local.location == location)
          fail("{}: {} is rank-local (derived from {}): no rank holds its whole value; intervene at a "
               "fragmented location such as {} instead",
               what, location, local.derived_from, local.derived_from);
      break;
    case LocationKind::kUnknown:
      fail("{}: unknown location '{}'; `frag inspect --all FILE` lists every location", what, location);
  }
}

void ShardedModel::on(const std::string& location, Hook hook, std::optional<int64_t> visit,
                      const std::string& label, bool edits) {
  check_location(location, label);
  runtime_->add(location, std::move(hook), visit, edits);
  descriptors_.push_back(fmt::format("{}@{}#{}", label, location, visit ? std::to_string(*visit) : "*"));
  agreed_ = false;
}

void ShardedModel::save(const std::string& location, const std::string& name, std::optional<int64_t> visit) {
  on(
      location,
      [this, name](torch::Tensor& whole, const VisitInfo& info) -> std::optional<torch::Tensor> {
        // A gathered whole that nothing edits after this save is kept as is: no copy.
        saved_[save_prefix_ + name].push_back(info.may_keep ? whole.detach() : whole.detach().clone());
        return std::nullopt;
      },
      visit, "save:" + name, /*edits=*/false);
}

void ShardedModel::apply(const Plan& plan) {
  // Check everything first: a bad step must fail before anything is registered or run.
  const auto dtype = model_dtype(rank_.module);
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    const auto& step = plan.steps[i];
    const std::string where = fmt::format("{}: intervention {} ({} at {})", plan.source, i, step.action, step.at);
    check_location(step.at, where);
    std::optional<int64_t> width;
    for (const auto& layer : table_.layers) {
      if (layer.input && ir::input_location(layer.path) == step.at) width = layer.input->whole_width;
      if (layer.output && ir::output_location(layer.path) == step.at) width = layer.output->whole_width;
    }
    if (step.index && width) step.index->check_last_dim(*width, where);
    if (step.action == "call") {
      auto calls = caller();
      for (const auto& path : step.modules) {
        try {
          calls.check_callable(path);
        } catch (const Error& e) {
          fail("{}: {}", where, e.what());
        }
      }
      if (step.modules.empty()) fail("{}: \"modules\" is empty", where);
      const int64_t expected = calls.expected_input_width(step.modules.front());
      if (width && expected > 0 && *width != expected)
        fail("{}: {} takes a whole input of width {}, but {} is {} wide", where, step.modules.front(), expected,
             step.at, *width);
    }
    if (step.value_tensor.defined()) {
      if (step.value_tensor.scalar_type() != dtype)
        fail("{}: value {} is {}, but the model computes in {}", where, step.value,
             c10::toString(step.value_tensor.scalar_type()), c10::toString(dtype));
      if (width && step.value_tensor.dim() > 0) {
        auto selected = step.index && (step.index->items.size() == 1 ||
                                       step.index->items.front().kind == IndexItem::Kind::kEllipsis)
                            ? step.index->select(torch::empty({*width}), step.at).size(-1)
                            : *width;
        const int64_t last = step.value_tensor.size(-1);
        if (!step.index || step.index->items.size() == 1 ||
            step.index->items.front().kind == IndexItem::Kind::kEllipsis)
          if (last != 1 && last != selected)
            fail("{}: value {} has last dim {}, but the selected whole has width {}", where, step.value, last,
                 selected);
      }
    }
  }
  for (const auto& step : plan.steps) register_step(step);
}

void ShardedModel::register_step(const PlanStep& step) {
  if (step.action == "save") {
    save(step.at, step.as, step.visit);
    return;
  }
  if (step.action == "call") {
    on(
        step.at,
        [this, step](torch::Tensor& whole, const VisitInfo&) -> std::optional<torch::Tensor> {
          saved_[save_prefix_ + step.as].push_back(caller().call(*context_, step.modules, whole));
          return std::nullopt;
        },
        step.visit, fmt::format("call:{}:{}", step.as, fmt::join(step.modules, ",")), /*edits=*/false);
    return;
  }
  const std::string label = fmt::format("{}:{}:{}:{}", step.action, step.index ? step.index->text : "",
                                        step.by, step.value);
  on(
      step.at,
      [step](torch::Tensor& whole, const VisitInfo& info) -> std::optional<torch::Tensor> {
        torch::Tensor target = step.index ? step.index->select(whole, info.location) : whole;
        if (step.action == "zero") {
          target.zero_();
        } else if (step.action == "scale") {
          target.mul_(step.by);
        } else {
          auto value = step.value_tensor.to(whole.device(), whole.scalar_type());
          try {
            if (step.action == "set") target.copy_(value.expand_as(target));
            else target.add_(value.expand_as(target));
          } catch (const c10::Error&) {
            fail("{}: value {} of shape [{}] does not fit the selected whole of shape [{}]", info.location,
                 step.value, fmt::join(value.sizes(), ", "), fmt::join(target.sizes(), ", "));
          }
        }
        return std::nullopt;
      },
      step.visit, label, /*edits=*/true);
}

void ShardedModel::clear() {
  runtime_->clear();
  descriptors_.clear();
  agreed_ = false;
}

void ShardedModel::agree_on_interventions() {
  // In registration order: hooks at one location run in that order, so it is part of the plan.
  const std::string mine = fmt::format(
      "{:016x}", digest(fmt::format("{}\n{}", fmt::join(descriptors_, "\n"), ir::to_json(table_).dump())));
  auto all = context_->exchange(fmt::format("interventions/{}", exchanges_++), mine);
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r] != all[0])
      fail("ranks hold different interventions or rule tables (digest {} on rank 0, {} on rank {}): every "
           "rank must load the same plan and files of one export; nothing was run",
           all[0], all[r], r);
  agreed_ = true;
}

torch::Tensor ShardedModel::forward(const torch::Tensor& input_ids) {
  if (!agreed_) agree_on_interventions();
  ScopedRankContext rank_scope(context_);
  ScopedInterventionRuntime runtime_scope(runtime_);
  runtime_->begin_forward();
  return run_forward(rank_, input_ids);
}

torch::Tensor ShardedModel::call(const std::vector<std::string>& paths, const torch::Tensor& whole) {
  return caller().call(*context_, paths, whole);
}

torch::Tensor ShardedModel::call_module(const std::string& path, const std::vector<torch::Tensor>& wholes) {
  return caller().call_module(*context_, path, wholes);
}

torch::Tensor ShardedModel::generate(const torch::Tensor& input_ids, int64_t steps) {
  torch::Tensor tokens = input_ids;
  for (int64_t s = 0; s < steps; ++s) {
    save_prefix_ = fmt::format("step{}.", s);
    auto logits = forward(tokens);
    auto next = logits.select(1, logits.size(1) - 1).argmax(-1, /*keepdim=*/true).to(tokens.dtype());
    tokens = torch::cat({tokens, next}, 1);
  }
  save_prefix_.clear();
  return tokens;
}

}  // namespace frag::runtime
