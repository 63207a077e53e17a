//===- runtime/intervention_runtime.cpp - Once-per-visit interventions ---===//
#include "runtime/intervention_runtime.h"

#include "ir/error.h"
#include "runtime/rank_context.h"
#include "runtime/whole_value.h"

#include <fmt/ranges.h>

#include <algorithm>

namespace frag::runtime {
namespace {

void check_replacement(const torch::Tensor& original, const torch::Tensor& replacement,
                       const std::string& location) {
  if (replacement.sizes() != original.sizes() || replacement.scalar_type() != original.scalar_type())
    fail("an intervention at {} returned a {} tensor of shape [{}], expected {} of shape [{}]", location,
         c10::toString(replacement.scalar_type()), fmt::join(replacement.sizes(), ", "),
         c10::toString(original.scalar_type()), fmt::join(original.sizes(), ", "));
}

}  // namespace

InterventionRuntime::InterventionRuntime(std::shared_ptr<const ir::LocationTable> locations)
    : locations_(std::move(locations)), states_(locations_->size()) {
  for (size_t id = 0; id < states_.size(); ++id) states_[id].entry = &locations_->at(static_cast<ir::LocationId>(id));
}

InterventionRuntime::Location& InterventionRuntime::state(ir::LocationId location) {
  // Ids come from the graph bound to this table; a bad one means a graph of another file.
  if (location < 0 || static_cast<size_t>(location) >= states_.size())
    fail("a fragment op names location id {}, but the location table has {}: the graph was bound to another table",
         location, states_.size());
  return states_[static_cast<size_t>(location)];
}

const InterventionRuntime::Location* InterventionRuntime::find(const std::string& location) const {
  auto id = locations_->find(location);
  return id ? &states_[static_cast<size_t>(*id)] : nullptr;
}

InterventionRuntime::Location& InterventionRuntime::in_this_forward(ir::LocationId location) {
  Location& entry = state(location);
  if (entry.forward != forward_) {
    entry.forward = forward_;
    entry.visits = 0;
    entry.visit = -1;
    entry.gathered = entry.edited = false;
  }
  return entry;
}

void InterventionRuntime::add(ir::LocationId location, Hook hook, std::optional<int64_t> visit, bool edits) {
  state(location).hooks.push_back(Registered{visit, std::move(hook), edits});
  ++changes_;
}

void InterventionRuntime::add(const std::string& location, Hook hook, std::optional<int64_t> visit, bool edits) {
  add(locations_->id_of(location, "an intervention"), std::move(hook), visit, edits);
}

void InterventionRuntime::clear() {
  for (auto& entry : states_) entry.hooks.clear();
  ++changes_;
}

void InterventionRuntime::begin_forward() { ++forward_; }

bool InterventionRuntime::has_hooks_at(ir::LocationId location) const {
  return location >= 0 && static_cast<size_t>(location) < states_.size() &&
         !states_[static_cast<size_t>(location)].hooks.empty();
}

std::vector<ir::LocationId> InterventionRuntime::hooked_locations() const {
  std::vector<ir::LocationId> hooked;
  for (size_t id = 0; id < states_.size(); ++id)
    if (!states_[id].hooks.empty()) hooked.push_back(static_cast<ir::LocationId>(id));
  return hooked;
}

int64_t InterventionRuntime::collectives_at(const std::string& location) const {
  const Location* entry = find(location);
  return entry == nullptr ? 0 : entry->collectives;
}

int64_t InterventionRuntime::visits_at(const std::string& location) const {
  const Location* entry = find(location);
  return entry == nullptr || entry->forward != forward_ ? 0 : entry->visits;
}

InterventionRuntime::Counts InterventionRuntime::counts() const {
  Counts counts;
  counts.visits.reserve(states_.size());
  counts.collectives.reserve(states_.size());
  for (const auto& entry : states_) {
    counts.visits.push_back(entry.forward == forward_ ? entry.visits : 0);
    counts.collectives.push_back(entry.collectives);
  }
  return counts;
}

void InterventionRuntime::replayed(const Counts& forward) {
  TORCH_INTERNAL_ASSERT(forward.visits.size() == states_.size() && forward.collectives.size() == states_.size());
  for (size_t id = 0; id < states_.size(); ++id) {
    if (forward.visits[id] == 0 && forward.collectives[id] == 0) continue;
    Location& entry = in_this_forward(static_cast<ir::LocationId>(id));
    entry.visits = forward.visits[id];
    entry.collectives += forward.collectives[id];
  }
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

namespace {

/// The rule of a fragmented location (the ops of a triple run only there).
const ir::FragmentRule& rule_of(const ir::LocationEntry& entry) {
  if (!entry.side) fail("a fragment triple runs at {}, which the location table lists as not fragmented", entry.name);
  return entry.side->rule;
}

}  // namespace

torch::Tensor InterventionRuntime::gather(const torch::Tensor& piece, ir::LocationId location) {
  Location& state = in_this_forward(location);
  const int64_t visit = open_visit(state);
  if (!waiting(state, visit)) return piece;
  const ir::LocationEntry& entry = *state.entry;
  const ir::FragmentRule& rule = rule_of(entry);
  torch::Tensor whole = whole_from_piece(current_rank_context().group(entry.group, rule.group), rule, piece, entry.name);
  ++state.collectives;
  state.gathered = true;
  return whole;
}

torch::Tensor InterventionRuntime::intervene(const torch::Tensor& value, ir::LocationId location, bool fragmented) {
  Location& state = in_this_forward(location);
  const int64_t visit = fragmented ? state.visit : open_visit(state);
  if (!waiting(state, visit)) return value;
  auto& hooks = state.hooks;
  VisitInfo info{state.entry->name, visit, fragmented && state.entry->side ? &state.entry->side->rule : nullptr,
                 false, location};
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
  // Inference tensors (NativeRT runs a .pt2 in inference mode) keep no version counter, so an in-place
  // edit cannot be seen there: any editing hook that ran counts as an edit (reads stay bit-identical:
  // saves do not edit).
  const bool versioned = !start.is_inference();
  const auto version = versioned ? start._version() : 0;
  bool edit_ran = false;
  const auto unchanged = [&] { return versioned ? start._version() == version : !edit_ran; };
  bool replaced = false;
  // Hooks from the last editing one on may change the whole; a hook before it
  // that kept the whole without a copy would see it change.
  size_t last_edit = 0;
  for (size_t i = 0; i < hooks.size(); ++i)
    if (hooks[i].edits && (!hooks[i].visit || *hooks[i].visit == visit)) last_edit = i + 1;
  for (size_t i = 0; i < hooks.size(); ++i) {
    auto& registered = hooks[i];
    if (registered.visit && *registered.visit != visit) continue;
    info.may_keep = fragmented && !replaced && unchanged() && i + 1 >= last_edit;
    edit_ran = edit_ran || registered.edits;
    if (auto replacement = registered.hook(current, info)) {
      check_replacement(current, *replacement, state.entry->name);
      current = *replacement;
      replaced = true;
    }
  }
  state.edited = replaced || !unchanged();
  return current;
}

torch::Tensor InterventionRuntime::split(const torch::Tensor& value, const torch::Tensor& piece,
                                         ir::LocationId location) {
  Location& state = in_this_forward(location);
  if (!state.gathered || !state.edited) return piece;  // reads hand back the original piece
  const ir::FragmentRule& rule = rule_of(*state.entry);
  const int64_t rank = current_rank_context().group(state.entry->group, rule.group).rank();
  return piece_from_whole(rule, value, rank).to(piece.options());
}

}  // namespace frag::runtime
