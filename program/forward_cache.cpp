//===- program/forward_cache.cpp - Forwards specialized to the hooked locations ===//
#include "program/forward_cache.h"

#include "program/recently_used.h"

#include <fmt/format.h>

namespace frag::program {

torch::jit::GraphFunction& ForwardCache::keeping(const PreparedRank& prepared,
                                                 const std::vector<ir::LocationId>& hooked) {
  if (auto* hit = find_recent(entries_, [&](const auto& entry) { return entry.first == hooked; }))
    return *hit->second;
  auto function =
      forward_keeping(prepared, hooked, fmt::format("__torch__.frag.forward_at_{}_locations", hooked.size()));
  return *add_recent(entries_, {hooked, std::move(function)}, kCapacity).second;
}

}  // namespace frag::program
