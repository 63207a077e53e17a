//===- program/forward_cache.h - Forwards specialized to the hooked locations -*- C++ -*-===//
//
// An idle triple costs a dispatch and a lookup; hundreds per forward show on
// a small model. So a forward runs a copy of the graph that keeps the
// fragment ops only where interventions wait (passes/remove_fragment_ops),
// built when the set of hooked locations changes. A generation loop
// alternates few sets and a server may churn, so the last few are kept (LRU).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "program/prepared_rank.h"

#include <torch/csrc/jit/api/function_impl.h>

#include <memory>
#include <utility>
#include <vector>

namespace frag::program {

class ForwardCache {
 public:
  static constexpr size_t kCapacity = 8;

  /// The forward keeping ops at exactly `hooked` (ascending ids): cached, or
  /// built (before the cache changes, so a failure leaves it as it was).
  torch::jit::GraphFunction& keeping(const PreparedRank& prepared, const std::vector<ir::LocationId>& hooked);

 private:
  /// Most recently used last.
  std::vector<std::pair<std::vector<ir::LocationId>, std::shared_ptr<torch::jit::GraphFunction>>> entries_;
};

}  // namespace frag::program
