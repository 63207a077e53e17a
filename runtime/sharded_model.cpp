//===- runtime/sharded_model.cpp - The C++ API: one rank of a sharded model ===//
#include "runtime/sharded_model.h"

#include "ir/error.h"
#include "passes/insert_fragment_ops.h"
#include "passes/remove_fragment_ops.h"
#include "passes/rewrite_for_fragments.h"

#include <fmt/ranges.h>
#include <torch/csrc/jit/api/function_impl.h>

#include <algorithm>
#include <unordered_set>

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

/// The module's own forward graph: the full rewrite.
std::shared_ptr<torch::jit::Graph> full_forward_graph(const torch::jit::Module& module) {
  return torch::jit::toGraphFunction(module.get_method("forward").function()).graph();
}

/// A function of the module's forward with fragment ops only at `kept`; call it with the module as self.
std::shared_ptr<torch::jit::GraphFunction> forward_keeping_ops_at(const torch::jit::Module& module,
                                                                  const std::unordered_set<std::string>& kept,
                                                                  const std::string& name) {
  auto graph = full_forward_graph(module)->copy();
  passes::remove_fragment_ops_except(*graph, kept);
  return std::make_shared<torch::jit::GraphFunction>(c10::QualifiedName(name), std::move(graph), nullptr);
}

}  // namespace

ShardedModel ShardedModel::load(std::shared_ptr<RankContext> context, const std::string& path,
                                const torch::Device& device, const std::string& rules_file) {
  ShardedModel model;
  model.context_ = std::move(context);
  model.rank_ = load_and_check_rank_module(*model.context_, path, device);
  // JIT fusers act on GPUs by default: with fragment ops only where a plan
  // waits, a fusion group could span a boundary in one run and not in another,
  // and a read-only plan would round differently from no plan.
  model.specialize_ = device.is_cpu();
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

void ShardedModel::check_against_width(const PlanStep& step, int64_t width, const std::string& where) const {
  if (step.index) step.index->check_last_dim(width, where);
  if (step.action == "call") {
    const int64_t expected = caller().expected_input_width(step.modules.front());
    if (expected > 0 && width != expected)
      fail("{}: {} takes a whole input of width {}, but {} is {} wide", where, step.modules.front(), expected, step.at,
           width);
  }
  if (step.value_tensor.defined() && step.value_tensor.dim() > 0) {
    // Only an index that ends on the last dim (one item, or "...," first) says which part of it is selected.
    const bool last_dim_indexed = !step.index || step.index->items.size() == 1 ||
                                  step.index->items.front().kind == IndexItem::Kind::kEllipsis;
    if (!last_dim_indexed) return;
    const int64_t selected = step.index ? step.index->select(torch::empty({width}), step.at).size(-1) : width;
    const int64_t last = step.value_tensor.size(-1);
    if (last != 1 && last != selected)
      fail("{}: value {} has last dim {}, but the selected whole has width {}", where, step.value, last, selected);
  }
}

void ShardedModel::apply(const Plan& plan) {
  // Check everything first: a bad step must fail before anything is registered or run.
  const auto dtype = model_dtype(rank_.module);
  std::vector<WidthCheck> later;
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    const auto& step = plan.steps[i];
    const std::string where = fmt::format("{}: intervention {} ({} at {})", plan.source, i, step.action, step.at);
    check_location(step.at, where);
    if (step.action == "call") {
      if (step.modules.empty()) fail("{}: \"modules\" is empty", where);
      auto calls = caller();
      for (const auto& path : step.modules) {
        try {
          calls.check_callable(path);
        } catch (const Error& e) {
          fail("{}: {}", where, e.what());
        }
      }
    }
    if (step.value_tensor.defined() && step.value_tensor.scalar_type() != dtype)
      fail("{}: value {} is {}, but the model computes in {}", where, step.value,
           c10::toString(step.value_tensor.scalar_type()), c10::toString(dtype));
    const bool needs_width =
        step.index || step.action == "call" || (step.value_tensor.defined() && step.value_tensor.dim() > 0);
    if (!needs_width) continue;
    if (auto width = whole_width_at(step.at)) check_against_width(step, *width, where);
    else later.push_back({step, where});  // a whole location not yet seen: checked before the next forward
  }
  for (const auto& step : plan.steps) register_step(step);
  width_checks_.insert(width_checks_.end(), later.begin(), later.end());
}

std::optional<int64_t> ShardedModel::whole_width_at(const std::string& location) const {
  if (const auto* side = table_.side_at(location); side && side->whole_width) return *side->whole_width;
  if (auto it = probed_widths_.find(location); it != probed_widths_.end()) return it->second;
  return std::nullopt;
}

void ShardedModel::check_widths_at_whole_locations(const torch::Tensor& input_ids) {
  // Whole locations (decoder layer outputs, residual streams) have no width in
  // the rule table. Learn them from one forward of the input's first token with
  // read-only hooks and check the steps before the real forward. Every rank
  // holds the same checks (agreed by digest), so every rank probes alike: the
  // model's own collectives, plus a gather where a fragmented side's width is
  // unknown too. The checks stay pending until they pass: a retry fails again.
  // The probe runs its own copy of the graph (ops only at the probed
  // locations): the forward's executor has not run yet, so the real forward
  // is optimized exactly as it would be without the probe (on GPUs the first
  // run and later runs may fuse, and round, differently).
  std::unordered_set<std::string> probed;
  for (const auto& check : width_checks_) probed.insert(check.step.at);
  auto probe_forward = forward_keeping_ops_at(rank_.module, probed, "__torch__.frag.width_probe");
  auto probe = std::make_shared<InterventionRuntime>();
  for (const auto& check : width_checks_)
    if (!probe->has_hooks_at(check.step.at))
      probe->add(
          check.step.at,
          [this](torch::Tensor& whole, const VisitInfo& info) -> std::optional<torch::Tensor> {
            if (whole.dim() > 0) probed_widths_.emplace(info.location, whole.size(-1));
            return std::nullopt;
          },
          std::nullopt, /*edits=*/false);
  {
    ScopedRankContext rank_scope(context_);
    ScopedInterventionRuntime runtime_scope(probe);
    probe->begin_forward();
    auto first_token = input_ids.dim() == 2 ? input_ids.narrow(0, 0, 1).narrow(1, 0, 1) : input_ids;
    run_forward(rank_, first_token, probe_forward.get());
  }
  // A location the probe did not reach (an expert no token was routed to, a
  // branch on length) is checked when first visited, on every rank alike.
  for (const auto& check : width_checks_)
    if (auto width = whole_width_at(check.step.at)) check_against_width(check.step, *width, check.where);
  width_checks_.clear();
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
  width_checks_.clear();
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
  if (!width_checks_.empty()) check_widths_at_whole_locations(input_ids);
  ScopedRankContext rank_scope(context_);
  ScopedInterventionRuntime runtime_scope(runtime_);
  runtime_->begin_forward();
  return run_forward(rank_, input_ids, forward_function());
}

torch::jit::Function* ShardedModel::forward_function() {
  if (!specialize_) return nullptr;
  if (runtime_->changes() == specialized_at_changes_) return specialized_forward_;
  auto hooked = runtime_->hooked_locations();
  // Most recently used last: a hit moves to the back, the front is evicted.
  auto hit = std::find_if(specialized_.begin(), specialized_.end(),
                          [&](const auto& entry) { return entry.first == hooked; });
  if (hit != specialized_.end()) {
    std::rotate(hit, hit + 1, specialized_.end());
  } else {
    // Built before anything changes, so a failure leaves the cache as it was.
    auto function = forward_keeping_ops_at(rank_.module, {hooked.begin(), hooked.end()},
                                           fmt::format("__torch__.frag.forward_at_{}_locations", hooked.size()));
    constexpr size_t kCachedSpecializations = 8;  // a generation loop alternates few sets; a server may churn
    if (specialized_.size() == kCachedSpecializations) specialized_.erase(specialized_.begin());
    specialized_.emplace_back(std::move(hooked), std::move(function));
  }
  specialized_at_changes_ = runtime_->changes();
  return specialized_forward_ = specialized_.back().second.get();
}

std::shared_ptr<torch::jit::Graph> ShardedModel::forward_graph() {
  if (auto* function = forward_function()) return torch::jit::toGraphFunction(*function).graph();
  return full_forward_graph(rank_.module);
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
