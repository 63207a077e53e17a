//===- program/captured_forwards.cpp - Forwards replayed from CUDA graphs ===//
#include "program/captured_forwards.h"

#include <algorithm>

namespace frag::program {

CapturedForwards::Entry& CapturedForwards::entry(const std::string& plan, bool specialize, const void* weights,
                                                 const torch::Tensor& input) {
  if (weights != weights_) {
    entries_.clear();
    weights_ = weights;
  }
  const auto sizes = input.sizes();
  auto hit = std::find_if(entries_.begin(), entries_.end(), [&](const auto& entry) {
    return entry->dtype == input.scalar_type() && sizes.equals(entry->shape) && entry->specialize == specialize &&
           entry->plan == plan;
  });
  if (hit != entries_.end()) {
    std::rotate(hit, hit + 1, entries_.end());
    return *entries_.back();
  }
  if (entries_.size() == kCapacity) entries_.erase(entries_.begin());
  auto fresh = std::make_unique<Entry>();
  fresh->plan = plan;
  fresh->specialize = specialize;
  fresh->shape.assign(sizes.begin(), sizes.end());
  fresh->dtype = input.scalar_type();
  entries_.push_back(std::move(fresh));
  return *entries_.back();
}

}  // namespace frag::program
