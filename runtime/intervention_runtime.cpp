//===- runtime/intervention_runtime.cpp - Once-per-visit interventions ---===//
#include "runtime/intervention_runtime.h"

#include "ir/error.h"
#include "runtime/rank_context.h"

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <mutex>

namespace frag::runtime {
namespace {

thread_local std::shared_ptr<InterventionRuntime> thread_runtime;
std::mutex process_mutex;
std::shared_ptr<InterventionRuntime> process_runtime;

void check_replacement(const torch::Tensor& original, const torch::Tensor& replacement,
                       const std::string& location) {
  if (replacement.sizes() != original.sizes() || replacement.scalar_type() != original.scalar_type())
    fail("an intervention at {} returned a {} tensor of shape [{}], expected {} of shape [{}]", location,
         c10::toString(replacement.scalar_type()), fmt::join(replacement.sizes(), ", "),
         c10::toString(original.scalar_type()), fmt::join(original.sizes(), ", "));
}

}  // namespace

InterventionRuntime::Location& InterventionRuntime::at(std::string_view location) {
  auto it = locations_.find(location);
  if (it != locations_.end()) return *it->second;
  auto state = std::make_unique<Location>();
  state->name = std::string(location);
  const std::string_view key = state->name;  // views the entry's own storage
  return *locations_.emplace(key, std::move(state)).first->second;
}

const InterventionRuntime::Location* InterventionRuntime::find(std::string_view location) const {
  auto it = locations_.find(location);
  return it == locations_.end() ? nullptr : it->second.get();
}

InterventionRuntime::Location& InterventionRuntime::in_this_forward(std::string_view location) {
  Location& state = at(location);
  if (state.forward != forward_) {
    state.forward = forward_;
    state.visits = 0;
    state.visit = -1;
    state.gathered = state.edited = false;
  }
  return state;
}

void InterventionRuntime::add(const std::string& location, Hook hook, std::optional<int64_t> visit,
                              bool edits) {
  at(location).hooks.push_back(Registered{visit, std::move(hook), edits});
  ++changes_;
}

void InterventionRuntime::clear() {
  for (auto& [name, state] : locations_) state->hooks.clear();
  ++changes_;
}

void InterventionRuntime::begin_forward() { ++forward_; }

bool InterventionRuntime::has_hooks_at(const std::string& location) const {
  const Location* state = find(location);
  return state != nullptr && !state->hooks.empty();
}

std::vector<std::string> InterventionRuntime::hooked_locations() const {
  std::vector<std::string> hooked;
  for (const auto& [name, state] : locations_)
    if (!state->hooks.empty()) hooked.push_back(state->name);
  std::sort(hooked.begin(), hooked.end());
  return hooked;
}

int64_t InterventionRuntime::collectives_at(const std::string& location) const {
  const Location* state = find(location);
  return state == nullptr ? 0 : state->collectives;
}

int64_t InterventionRuntime::visits_at(const std::string& location) const {
  const Location* state = find(location);
  return state == nullptr || state->forward != forward_ ? 0 : state->visits;
}

bool InterventionRuntime::waiting(const Location& state, int64_t visit) {
  for (const auto& registered : state.hooks)
    if (!registered.visit || *registered.visit == visit) return true;
  return false;
}

int64_t InterventionRuntime::open_visit(Location& state) {
  state.visit = state.visits++;
  state.gathered = state.edited = false;
  return state.visit;
}

const ir::FragmentRule& InterventionRuntime::rule(Location& state, std::string_view rule_json) {
  if (!state.rule || state.rule_json != rule_json) {
    state.rule = ir::rule_from_json(nlohmann::json::parse(rule_json));
    state.rule_json = std::string(rule_json);
  }
  return *state.rule;
}

torch::Tensor InterventionRuntime::gather(const torch::Tensor& piece, std::string_view location,
                                          std::string_view rule_json) {
  Location& state = in_this_forward(location);
  const int64_t visit = open_visit(state);
  if (!waiting(state, visit)) return piece;
  const ir::FragmentRule& fragment_rule = rule(state, rule_json);
  Communicator& group = current_rank_context().group(fragment_rule.group);
  if (group.size() != fragment_rule.group_size)
    fail("{} is fragmented over {} ranks of group '{}', but this run's group has {}", location,
         fragment_rule.group_size, fragment_rule.group, group.size());
  torch::Tensor whole;
  switch (ir::collective_for(fragment_rule)) {
    case ir::CollectiveKind::kAllReduce:
      whole = group.all_reduce(piece);
      break;
    case ir::CollectiveKind::kAllGather:
      whole = ir::whole_from_pieces(fragment_rule, group.all_gather(piece));
      break;
    case ir::CollectiveKind::kNone:
      whole = piece.clone();
      break;
  }
  ++state.collectives;
  state.gathered = true;
  return whole;
}

torch::Tensor InterventionRuntime::intervene(const torch::Tensor& value, std::string_view location,
                                             bool fragmented) {
  Location& state = in_this_forward(location);
  const int64_t visit = fragmented ? state.visit : open_visit(state);
  if (!waiting(state, visit)) return value;
  auto& hooks = state.hooks;
  VisitInfo info{state.name, visit, fragmented && state.rule ? &*state.rule : nullptr};
  torch::Tensor current = value;
  if (!fragmented) {
    // A gathered whole is already a fresh tensor; a whole location's value is
    // the model's own, shared with its other users: edit a copy.
    for (const auto& registered : hooks)
      if (registered.edits && (!registered.visit || *registered.visit == visit)) {
        current = value.clone();
        break;
      }
  }
  const torch::Tensor start = current;
  const auto version = start._version();
  bool replaced = false;
  // Hooks from the last editing one on may change the whole; a hook before it
  // that kept the whole without a copy would see it change.
  size_t last_edit = 0;
  for (size_t i = 0; i < hooks.size(); ++i)
    if (hooks[i].edits && (!hooks[i].visit || *hooks[i].visit == visit)) last_edit = i + 1;
  for (size_t i = 0; i < hooks.size(); ++i) {
    auto& registered = hooks[i];
    if (registered.visit && *registered.visit != visit) continue;
    info.may_keep = fragmented && !replaced && start._version() == version && i + 1 >= last_edit;
    if (auto replacement = registered.hook(current, info)) {
      check_replacement(current, *replacement, state.name);
      current = *replacement;
      replaced = true;
    }
  }
  state.edited = replaced || start._version() != version;
  return current;
}

torch::Tensor InterventionRuntime::split(const torch::Tensor& value, const torch::Tensor& piece,
                                         std::string_view location, std::string_view rule_json) {
  Location& state = in_this_forward(location);
  if (!state.gathered || !state.edited) return piece;  // reads hand back the original piece
  const ir::FragmentRule& fragment_rule = rule(state, rule_json);
  const int64_t rank = current_rank_context().group(fragment_rule.group).rank();
  return ir::piece_of_whole(fragment_rule, value, rank).to(piece.options());
}

InterventionRuntime* current_intervention_runtime() {
  if (thread_runtime) return thread_runtime.get();
  std::lock_guard<std::mutex> lock(process_mutex);
  return process_runtime.get();
}

void set_process_intervention_runtime(std::shared_ptr<InterventionRuntime> runtime) {
  std::lock_guard<std::mutex> lock(process_mutex);
  process_runtime = std::move(runtime);
}

ScopedInterventionRuntime::ScopedInterventionRuntime(std::shared_ptr<InterventionRuntime> runtime)
    : previous_(std::move(thread_runtime)) {
  thread_runtime = std::move(runtime);
}

ScopedInterventionRuntime::~ScopedInterventionRuntime() { thread_runtime = std::move(previous_); }

}  // namespace frag::runtime
