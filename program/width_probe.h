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

#include <map>
#include <memory>
#include <vector>

namespace frag::program {

/// The last-dim widths at `locations` seen in one forward of `input_ids`'
/// first token; a location the forward did not reach (an expert no token was
/// routed to) is absent.
std::map<ir::LocationId, int64_t> probe_widths(RankProgram& program,
                                               const std::shared_ptr<runtime::RankContext>& context,
                                               const std::vector<ir::LocationId>& locations,
                                               const torch::Tensor& input_ids);

}  // namespace frag::program
