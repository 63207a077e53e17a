//===- program/plan_binder.cpp - Plan steps and callbacks as hooks ===//
#include "program/plan_binder.h"

#include "ir/error.h"

#include <algorithm>
#include <fmt/ranges.h>

namespace frag::program {

using runtime::Action;
using runtime::PlanStep;
using runtime::VisitInfo;

/// A registered plan step and what its hook needs at a visit.
struct BoundStep {
  PlanStep step;
  std::string where;  ///< names the step in errors its hook raises while the forward runs
  bool filtered = false;  ///< acts at some generation steps or rows only: decided on the host at each visit
  SavedValues::Slot slot = 0;  ///< where a save or call keeps its result
  std::shared_ptr<VisitState> state;
  runtime::AdHocCaller caller;
  std::shared_ptr<runtime::RankContext> context;
  /// An edit's value on the whole's device and dtype, made on the first visit: later visits (and a CUDA
  /// graph's capture, which cannot copy from host memory) reuse it.
  torch::Tensor value;
};

namespace {

/// How an action is checked, described and run: one row per action (rule_of).
struct ActionRule {
  bool edits;
  /// Checked against its whole's width even without an index or a value (a call: its module's input).
  bool needs_width;
  /// Its checks at registration, beyond the location, heads and value dtype every step gets.
  void (*check)(const PlanStep& step, const runtime::AdHocCaller& caller, const std::string& where);
  /// Its checks against the whole's last-dim width, beyond the index and value every step gets.
  void (*check_width)(const PlanStep& step, int64_t width, const runtime::AdHocCaller& caller,
                      const std::string& where);
  /// The hook's label for the ranks' agreement (a step acting at all steps and rows).
  std::string (*label)(const PlanStep& step);
  /// What it does at a visit to `part`: the whole, or the step's rows copied out of it.
  void (*run)(BoundStep& bound, torch::Tensor& part, const VisitInfo& info);
};

void no_check(const PlanStep&, const runtime::AdHocCaller&, const std::string&) {}
void no_width_check(const PlanStep&, int64_t, const runtime::AdHocCaller&, const std::string&) {}

void check_call(const PlanStep& step, const runtime::AdHocCaller& caller, const std::string& where) {
  if (step.modules.empty()) fail("{}: \"modules\" is empty", where);
  for (const auto& path : step.modules) {
    try {
      caller.check_callable(path);
    } catch (const Error& e) {
      fail("{}: {}", where, e.what());
    }
  }
}

void check_call_width(const PlanStep& step, int64_t width, const runtime::AdHocCaller& caller,
                      const std::string& where) {
  const int64_t expected = caller.expected_input_width(step.modules.front());
  if (expected > 0 && width != expected)
    fail("{}: {} takes a whole input of width {}, but {} is {} wide", where, step.modules.front(), expected, step.at,
         width);
}

std::string save_label(const PlanStep& step) {
  return step.index ? fmt::format("save:{}[{}]", step.as, step.index->text) : "save:" + step.as;
}
std::string call_label(const PlanStep& step) { return "call:" + step.describe(); }
std::string edit_label(const PlanStep& step) { return "edit:" + step.describe(); }

void run_save(BoundStep& bound, torch::Tensor& part, const VisitInfo& info) {
  const PlanStep& step = bound.step;
  torch::Tensor value;
  if (step.index)  // a copy of the slice alone, not a view that keeps the whole alive
    value = step.index->select(part.detach(), info.location).clone(at::MemoryFormat::Contiguous);
  else if (bound.filtered)
    value = part.detach().clone(at::MemoryFormat::Contiguous);
  else  // a gathered whole that nothing edits after this save is kept as is: no copy
    value = info.may_keep ? part.detach() : part.detach().clone();
  bound.state->saved.keep(bound.slot, std::move(value));
}

void run_call(BoundStep& bound, torch::Tensor& part, const VisitInfo&) {
  torch::Tensor result;
  try {
    result = bound.caller.call(*bound.context, bound.step.modules, part);
  } catch (const Error& e) {  // a chain in the wrong order, say: name the step
    fail("{}: {}", bound.where, e.what());
  }
  bound.state->saved.keep(bound.slot, std::move(result));
}

/// The part of the whole an edit step changes.
torch::Tensor edit_target(const BoundStep& bound, torch::Tensor& part, const VisitInfo& info) {
  return bound.step.index ? bound.step.index->select(part, info.location) : part;
}

void run_zero(BoundStep& bound, torch::Tensor& part, const VisitInfo& info) { edit_target(bound, part, info).zero_(); }

void run_scale(BoundStep& bound, torch::Tensor& part, const VisitInfo& info) {
  edit_target(bound, part, info).mul_(bound.step.by);
}

void run_set_or_add(BoundStep& bound, torch::Tensor& part, const VisitInfo& info) {
  const PlanStep& step = bound.step;
  torch::Tensor target = edit_target(bound, part, info);
  torch::Tensor& value = bound.value;
  if (!value.defined() || value.device() != target.device() || value.scalar_type() != target.scalar_type())
    value = step.value_tensor.to(target.device(), target.scalar_type());
  try {
    if (step.action == Action::kSet) target.copy_(value.expand_as(target));
    else target.add_(value.expand_as(target));
  } catch (const c10::Error&) {
    fail("{}: value {} of shape [{}] does not fit the selected whole of shape [{}]", info.location, step.value,
         fmt::join(value.sizes(), ", "), fmt::join(target.sizes(), ", "));
  }
}

/// The one switch over actions.
const ActionRule& rule_of(Action action) {
  static const ActionRule kSave{false, false, no_check, no_width_check, save_label, run_save};
  static const ActionRule kCall{false, true, check_call, check_call_width, call_label, run_call};
  static const ActionRule kSetOrAdd{true, false, no_check, no_width_check, edit_label, run_set_or_add};
  static const ActionRule kScale{true, false, no_check, no_width_check, edit_label, run_scale};
  static const ActionRule kZero{true, false, no_check, no_width_check, edit_label, run_zero};
  switch (action) {
    case Action::kSave:
      return kSave;
    case Action::kCall:
      return kCall;
    case Action::kSet:
    case Action::kAdd:
      return kSetOrAdd;
    case Action::kScale:
      return kScale;
    case Action::kZero:
      return kZero;
  }
  TORCH_INTERNAL_ASSERT(false, "rule_of: an action without a rule");
}

/// Whether a step is checked against its whole's last-dim width.
bool needs_width(const PlanStep& step) {
  return step.index || rule_of(step.action).needs_width || (step.value_tensor.defined() && step.value_tensor.dim() > 0);
}

/// A step's index, value and action against the whole's last-dim width.
void check_against_width(const PlanStep& step, int64_t width, const runtime::AdHocCaller& caller,
                         const std::string& where) {
  if (step.index) step.index->check_last_dim(width, where);
  rule_of(step.action).check_width(step, width, caller, where);
  if (!step.value_tensor.defined() || step.value_tensor.dim() == 0) return;
  // Only an index that ends on the last dim (one item, or "...," first) says which part of it is selected.
  const bool last_dim_indexed = !step.index || step.index->items.size() == 1 ||
                                step.index->items.front().kind == runtime::IndexItem::Kind::kEllipsis;
  if (!last_dim_indexed) return;
  const int64_t selected = step.index ? step.index->select(torch::empty({width}), step.at).size(-1) : width;
  const int64_t last = step.value_tensor.size(-1);
  if (last != 1 && last != selected)
    fail("{}: value {} has last dim {}, but the selected whole has width {}", where, step.value, last, selected);
}

/// The rows a plan step names, as an index into dim 0 of `whole`: in generation the batch rows whose stable
/// ids it names (none: an empty index), else batch indices (frag::Error past the batch).
torch::Tensor row_index(const PlanStep& step, const torch::Tensor& whole, const std::string& location,
                        const std::vector<int64_t>& row_ids) {
  if (!row_ids.empty()) {
    std::vector<int64_t> at;
    for (size_t i = 0; i < row_ids.size(); ++i)
      if (std::binary_search(step.rows.begin(), step.rows.end(), row_ids[i])) at.push_back(static_cast<int64_t>(i));
    return torch::tensor(at, torch::kLong).to(whole.device());
  }
  if (whole.dim() == 0 || step.rows.back() >= whole.size(0))
    fail("{}: \"rows\" [{}] of a plan step at {}: the batch has {} rows", location, fmt::join(step.rows, ", "),
         step.at, whole.dim() == 0 ? 0 : whole.size(0));
  return torch::tensor(step.rows, torch::kLong).to(whole.device());
}

/// The real rows of `whole` (VisitState::real_rows): a view, so edits made to it land in the whole.
torch::Tensor real_rows_of(const torch::Tensor& whole, const VisitState& state) {
  if (!state.real_rows || whole.dim() == 0 || whole.size(0) <= *state.real_rows) return whole;
  return whole.narrow(0, 0, *state.real_rows);
}

/// What a bound step does at a visit: the whole, or (filtered) only at its steps and on its rows; in a
/// padded batch bucket, on the real rows only.
std::optional<torch::Tensor> visit(BoundStep& bound, const ActionRule& rule, torch::Tensor& padded,
                                   const VisitInfo& info) {
  torch::Tensor whole = real_rows_of(padded, *bound.state);
  if (!bound.filtered) {
    rule.run(bound, whole, info);
    return std::nullopt;
  }
  if (!bound.step.acts_at(bound.state->generation_step)) return std::nullopt;
  const torch::Tensor rows = bound.step.rows.empty()
                                ? torch::Tensor()
                                : row_index(bound.step, whole, info.location, bound.state->row_ids);
  if (rows.defined() && rows.numel() == 0) return std::nullopt;  // none of its rows is in this batch
  torch::Tensor part = rows.defined() ? whole.index_select(0, rows) : whole;  // a copy where rows
  rule.run(bound, part, info);
  if (rule.edits && rows.defined()) whole.index_copy_(0, rows, part);
  return std::nullopt;
}

}  // namespace

PlanBinder::PlanBinder(std::shared_ptr<RankProgram> program, std::shared_ptr<runtime::RankContext> context,
                       std::shared_ptr<runtime::InterventionRuntime> runtime)
    : program_(std::move(program)), context_(std::move(context)), runtime_(std::move(runtime)) {}

ir::LocationId PlanBinder::checked_location(const std::string& location, const std::string& what) const {
  const ir::LocationId id = locations().id_of(location, what);
  const auto& entry = locations().at(id);
  if (entry.kind == ir::LocationKind::kRankLocal) {
    // Where the rewrite saw this very value gathered (act_fn's output is down_proj's input), that location
    // holds its whole; the location it derives from (gate_up_proj's output) holds another value.
    std::string whole_at;
    for (const auto& local : locations().fragments().rank_local)
      if (local.location == location) whole_at = local.whole_at;
    if (!whole_at.empty())
      fail("{}: {} is rank-local (derived from {}): no rank holds its whole value here; the same value is "
           "whole at {}: intervene there instead",
           what, location, entry.derived_from, whole_at);
    fail("{}: {} is rank-local (derived from {}): no rank holds its whole value; intervene at a fragmented "
         "location (`frag inspect` lists them), e.g. the input of the parallel layer it flows into",
         what, location, entry.derived_from);
  }
  return id;
}

ir::HeadLayout PlanBinder::head_layout(const std::string& location) const {
  // The layer's config lives in its module's integer attributes (head_size, total_num_heads, ...).
  return ir::head_layout(locations().fragments(), location,
                         [this](const std::string& path) { return program_->int_attributes(path); });
}

void PlanBinder::check_step(PlanStep& step, ir::LocationId id, const std::string& where, const std::string& prefix) {
  runtime::resolve_heads(step, head_layout(step.at), prefix);
  const runtime::AdHocCaller caller(*program_, locations());
  rule_of(step.action).check(step, caller, where);
  const auto dtype = program_->dtype();
  if (step.value_tensor.defined() && step.value_tensor.scalar_type() != dtype)
    fail("{}: value {} is {}, but the model computes in {}", where, step.value,
         c10::toString(step.value_tensor.scalar_type()), c10::toString(dtype));
  if (!needs_width(step)) return;
  if (auto width = widths_.at(locations(), id)) check_against_width(step, *width, caller, where);
}

void PlanBinder::bind(const runtime::Plan& plan) {
  // Check everything first: a bad step must fail before anything is registered or run.
  std::vector<ir::LocationId> ids;
  std::vector<std::string> wheres;
  std::vector<PlanStep> steps = plan.steps;  // resolved against this model: "segment"/"heads" become indices
  for (size_t i = 0; i < steps.size(); ++i) {
    wheres.push_back(fmt::format("{}: intervention {} ({} at {})", plan.source, i,
                                 runtime::action_name(steps[i].action), steps[i].at));
    ids.push_back(checked_location(steps[i].at, wheres[i]));
    check_step(steps[i], ids[i], wheres[i], fmt::format("{}: intervention {}: ", plan.source, i));
  }
  const runtime::AdHocCaller caller(*program_, locations());
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto& step = steps[i];
    if (needs_width(step) && !widths_.at(locations(), ids[i]))  // a whole location not yet seen
      widths_.defer(ids[i], [step, caller, where = wheres[i]](int64_t width) {
        check_against_width(step, width, caller, where);
      });
    bind_step(step, ids[i], wheres[i]);
  }
}

void PlanBinder::bind_step(const PlanStep& step, ir::LocationId location, std::string where) {
  auto bound = std::make_shared<BoundStep>(BoundStep{step, std::move(where), !step.steps.empty() || !step.rows.empty(),
                                                     0, state_, runtime::AdHocCaller(*program_, locations()),
                                                     context_, torch::Tensor()});
  const ActionRule& rule = rule_of(step.action);
  if (!rule.edits) bound->slot = state_->saved.slot(step.as);  // the name, resolved once
  // A filtered step's hook decides on the host at each visit: no CUDA graph may hold it.
  const std::string label =
      bound->filtered ? fmt::format("{}:{}", rule.edits ? "edit" : "save", step.describe()) : rule.label(step);
  add_hook(
      location,
      [bound, &rule](torch::Tensor& whole, const VisitInfo& info) { return visit(*bound, rule, whole, info); },
      step.visit, label, rule.edits, /*capturable=*/!bound->filtered);
  bound_.push_back(std::move(bound));
}

void PlanBinder::save(ir::LocationId location, const std::string& name, std::optional<int64_t> visit) {
  PlanStep step;
  step.at = locations().at(location).name;
  step.action = Action::kSave;
  step.as = name;
  step.visit = visit;
  bind_step(step, location, "save:" + name);
}

void PlanBinder::on(ir::LocationId location, runtime::Hook hook, std::optional<int64_t> visit,
                    const std::string& label, bool edits) {
  // A callback sees the real rows of a padded batch bucket, as plan steps do; its replacement of them
  // is written into the whole's real rows.
  auto real_rows_hook = [hook = std::move(hook), state = state_](torch::Tensor& padded,
                                                                 const VisitInfo& info) -> std::optional<torch::Tensor> {
    torch::Tensor whole = real_rows_of(padded, *state);
    if (whole.is_same(padded)) return hook(padded, info);
    auto replaced = hook(whole, info);
    if (!replaced) return std::nullopt;
    torch::Tensor copy = padded.clone();
    copy.narrow(0, 0, whole.size(0)).copy_(*replaced);
    return copy;
  };
  add_hook(location, std::move(real_rows_hook), visit, label, edits, /*capturable=*/false);
}

void PlanBinder::add_hook(ir::LocationId location, runtime::Hook hook, std::optional<int64_t> visit,
                          const std::string& label, bool edits, bool capturable) {
  runtime_->add(location, std::move(hook), visit, edits);
  if (!capturable) ++callbacks_;
  if (visit) single_visits_.emplace_back(location, *visit);
  agreement_.add(fmt::format("{}@{}#{}", label, locations().at(location).name, visit ? std::to_string(*visit) : "*"));
}

void PlanBinder::clear() {
  runtime_->clear();
  callbacks_ = 0;
  widths_.clear_pending();
  agreement_.clear();
  bound_.clear();
  single_visits_.clear();
}

std::vector<torch::Tensor> PlanBinder::device_values() const {
  std::vector<torch::Tensor> values;
  for (const auto& bound : bound_)
    if (bound->value.defined()) values.push_back(bound->value);
  return values;
}

std::vector<std::string> PlanBinder::unreached_visits() const {
  std::vector<std::string> lines;
  for (const auto& [id, visit] : single_visits_) {
    const std::string& name = locations().at(id).name;
    const int64_t visits = runtime_->visits_at(name);
    if (visit >= visits)
      lines.push_back(fmt::format("visit {} at {} was never reached: the last forward visited it {} time{}", visit,
                                  name, visits, visits == 1 ? "" : "s"));
  }
  return lines;
}

}  // namespace frag::program
