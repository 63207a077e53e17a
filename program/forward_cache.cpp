//===- program/forward_cache.cpp - Forwards specialized to the hooked locations ===//
#include "program/forward_cache.h"

#include <fmt/format.h>

#include <algorithm>

namespace frag::program {

torch::jit::GraphFunction& ForwardCache::keeping(const PreparedRank& prepared,
                                                 const std::vector<ir::LocationId>& hooked) {
  auto hit = std::find_if(entries_.begin(), entries_.end(), [&](const auto& entry) { return entry.first == hooked; });
  if (hit != entries_.end()) {
    std::rotate(hit, hit + 1, entries_.end());
    return *entries_.back().second;
  }
  auto function =
      forward_keeping(prepared, hooked, fmt::format("__torch__.frag.forward_at_{}_locations", hooked.size()));
  if (entries_.size() == kCapacity) entries_.erase(entries_.begin());
  entries_.emplace_back(hooked, std::move(function));
  return *entries_.back().second;
}

}  // namespace frag::program
