//===- program/width_probe.h - Widths of whole locations, learned by running -*- C++ -*-===//
//
// Whole locations (decoder layer outputs, residual streams) have no width in
// the rule table, so a plan's index or value there cannot be checked at load.
// The probe learns them from one forward of the input's first token with
// read-only hooks, before the real forward. Every rank holds the same checks
// (agreed by digest), so every rank probes alike.
//
// The probe runs a forward used once (RankProgram::Use::kOnce: ops only at the
// probed locations, not cached) and its own intervention runtime: the model's
// forward and its executor are untouched, so the real forward is optimized
// exactly as without the probe (on GPUs the first run and later runs may fuse,
// and round, differently).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "program/rank_program.h"
#include "runtime/rank_context.h"

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

namespace frag::program {

/// The last-dim widths at `locations` seen in one forward of `input_ids`'
/// first token; a location the forward did not reach (an expert no token was
/// routed to) is absent.
std::map<ir::LocationId, int64_t> probe_widths(RankProgram& program,
                                               const std::shared_ptr<runtime::RankContext>& context,
                                               const std::vector<ir::LocationId>& locations,
                                               const torch::Tensor& input_ids);

/// The last-dim widths of whole values a plan's checks need: the rule table's, else probed; the checks
/// that must wait for a probe, run before the next forward.
class WholeWidths {
 public:
  /// The width at `location`: from the rule table, or learned by a probe; else unknown.
  std::optional<int64_t> at(const ir::LocationTable& locations, ir::LocationId location) const;
  /// Runs `check` on the width at `location` before the next forward (check_pending).
  void defer(ir::LocationId location, std::function<void(int64_t)> check);
  bool pending() const { return !checks_.empty(); }
  /// Probes the locations of the deferred checks (probe_widths) and runs the checks whose width is
  /// known now; a location the probe did not reach (an expert no token was routed to, a branch on
  /// length) is checked when first visited, on every rank alike. A check that throws stays pending.
  void check_pending(RankProgram& program, const std::shared_ptr<runtime::RankContext>& context,
                     const torch::Tensor& input_ids);
  /// Drops the deferred checks (the plan they belong to was cleared); learned widths stay.
  void clear_pending() { checks_.clear(); }

 private:
  std::vector<std::pair<ir::LocationId, std::function<void(int64_t)>>> checks_;
  std::map<ir::LocationId, int64_t> probed_;
};

}  // namespace frag::program
