//===- program/saved_values.cpp - Saved whole tensors, by slot and step ===//
#include "program/saved_values.h"

#include <fmt/format.h>

namespace frag::program {

SavedValues::Slot SavedValues::slot(const std::string& name) {
  auto [it, added] = slots_.emplace(name, static_cast<Slot>(names_.size()));
  if (added) names_.push_back(name);
  return it->second;
}

void SavedValues::keep(Slot slot, torch::Tensor value) {
  if (rows_ && value.dim() > 0 && value.size(0) > *rows_) value = value.narrow(0, 0, *rows_);
  if (redirect_ != nullptr) redirect_->emplace_back(slot, std::move(value));
  else pending_.push_back({slot, step_, std::move(value)});
}

std::vector<torch::Tensor>& SavedValues::list_of(Slot slot, std::optional<int64_t> step) const {
  if (lists_.size() <= slot) lists_.resize(slot + 1);
  auto& by_step = lists_[slot];
  const size_t at = step ? static_cast<size_t>(*step) + 1 : 0;
  if (by_step.size() <= at) by_step.resize(at + 1, nullptr);
  if (by_step[at] == nullptr)
    by_step[at] = &view_[step ? fmt::format("step{}.{}", *step, names_[slot]) : names_[slot]];
  return *by_step[at];
}

const SavedTensors& SavedValues::view() const {
  for (auto& kept : pending_) list_of(kept.slot, kept.step).push_back(std::move(kept.value));
  pending_.clear();
  return view_;
}

void SavedValues::clear() {
  pending_.clear();
  view_.clear();
  lists_.clear();
}

}  // namespace frag::program
