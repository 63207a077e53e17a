//===- program/captured_forwards.cpp - Forwards replayed from CUDA graphs ===//
#include "program/captured_forwards.h"

#include "program/recently_used.h"

namespace frag::program {

CapturedForwards::Entry& CapturedForwards::entry(const std::string& plan, bool specialize, const void* weights,
                                                 const torch::Tensor& input) {
  if (weights != weights_) {
    entries_.clear();
    weights_ = weights;
  }
  const auto sizes = input.sizes();
  if (auto* hit = find_recent(entries_, [&](const auto& entry) {
        return entry->dtype == input.scalar_type() && sizes.equals(entry->shape) &&
               entry->specialize == specialize && entry->plan == plan;
      }))
    return **hit;
  auto fresh = std::make_unique<Entry>();
  fresh->plan = plan;
  fresh->specialize = specialize;
  fresh->shape.assign(sizes.begin(), sizes.end());
  fresh->dtype = input.scalar_type();
  return *add_recent(entries_, std::move(fresh), kCapacity);
}

}  // namespace frag::program
