//===- runtime/intervention_runtime.cpp - Once-per-visit interventions ---===//
#include "runtime/intervention_runtime.h"

#include "ir/error.h"
#include "runtime/rank_context.h"

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

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

void InterventionRuntime::add(const std::string& location, Hook hook, std::optional<int64_t> visit,
                              bool edits) {
  hooks_[location].push_back(Registered{visit, std::move(hook), edits});
}

void InterventionRuntime::clear() { hooks_.clear(); }

void InterventionRuntime::begin_forward() {
  visit_counts_.clear();
  open_.clear();
}

bool InterventionRuntime::has_hooks_at(const std::string& location) const {
  auto it = hooks_.find(location);
  return it != hooks_.end() && !it->second.empty();
}

std::vector<std::string> InterventionRuntime::hooked_locations() const {
  std::vector<std::string> locations;
  for (const auto& [location, hooks] : hooks_)
    if (!hooks.empty()) locations.push_back(location);
  return locations;
}

int64_t InterventionRuntime::collectives_at(const std::string& location) const {
  auto it = collectives_.find(location);
  return it == collectives_.end() ? 0 : it->second;
}

int64_t InterventionRuntime::visits_at(const std::string& location) const {
  auto it = visit_counts_.find(location);
  return it == visit_counts_.end() ? 0 : it->second;
}

bool InterventionRuntime::waiting(const std::string& location, int64_t visit) const {
  auto it = hooks_.find(location);
  if (it == hooks_.end()) return false;
  for (const auto& registered : it->second)
    if (!registered.visit || *registered.visit == visit) return true;
  return false;
}

int64_t InterventionRuntime::open_visit(const std::string& location) {
  const int64_t visit = visit_counts_[location]++;
  open_[location] = OpenVisit{visit, false, false};
  return visit;
}

const ir::FragmentRule& InterventionRuntime::rule(const std::string& rule_json) {
  auto it = rules_.find(rule_json);
  if (it == rules_.end()) it = rules_.emplace(rule_json, ir::rule_from_json(nlohmann::json::parse(rule_json))).first;
  return it->second;
}

torch::Tensor InterventionRuntime::gather(const torch::Tensor& piece, const std::string& location,
                                          const std::string& rule_json) {
  const int64_t visit = open_visit(location);
  if (!waiting(location, visit)) return piece;
  const ir::FragmentRule& fragment_rule = rule(rule_json);
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
  ++collectives_[location];
  open_[location].gathered = true;
  open_[location].rule = &fragment_rule;
  return whole;
}

torch::Tensor InterventionRuntime::intervene(const torch::Tensor& value, const std::string& location,
                                             bool fragmented) {
  const int64_t visit = fragmented ? open_[location].visit : open_visit(location);
  if (!waiting(location, visit)) return value;
  VisitInfo info{location, visit, fragmented ? open_[location].rule : nullptr};
  auto& hooks = hooks_[location];
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
  for (auto& registered : hooks) {
    if (registered.visit && *registered.visit != visit) continue;
    if (auto replacement = registered.hook(current, info)) {
      check_replacement(current, *replacement, location);
      current = *replacement;
      replaced = true;
    }
  }
  open_[location].edited = replaced || start._version() != version;
  return current;
}

torch::Tensor InterventionRuntime::split(const torch::Tensor& value, const torch::Tensor& piece,
                                         const std::string& location, const std::string& rule_json) {
  const OpenVisit& state = open_[location];
  if (!state.gathered || !state.edited) return piece;  // reads hand back the original piece
  const ir::FragmentRule& fragment_rule = rule(rule_json);
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
