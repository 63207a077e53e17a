//===- passes/pending_rank_local.h - Rank-local values waiting to be gathered -*- C++ -*-===//
//
// A rank-local location (act_fn's output: no rank holds its whole) may hold the
// very value a later fragmented location gathers whole (down_proj's input):
// the table's entry then says where its whole is (`whole_at`), so a plan at the
// rank-local location can be sent there. Both analyses keep these pending
// entries by their own value ids: the TorchScript one (passes/
// analyze_location_flow, flow numbers) and the .pt2 one
// (passes/insert_fragment_ops_pt2, node names).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/fragment_table.h"

#include <string>
#include <unordered_map>
#include <vector>

namespace frag::passes {

template <typename ValueId>
class PendingRankLocal {
 public:
  /// `value` is the value of the table's rank-local entry `entry`.
  void add(const ValueId& value, size_t entry) { pending_[value].push_back(entry); }

  /// `value` is gathered whole at `location`: each entry waiting on it that has no whole_at yet gets it.
  void gathered(const ValueId& value, const std::string& location, ir::FragmentTable& table) {
    auto pending = pending_.find(value);
    if (pending == pending_.end()) return;
    for (const size_t entry : pending->second)
      if (table.rank_local[entry].whole_at.empty()) table.rank_local[entry].whole_at = location;
    pending_.erase(pending);
  }

 private:
  std::unordered_map<ValueId, std::vector<size_t>> pending_;
};

}  // namespace frag::passes
