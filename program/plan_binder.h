//===- program/plan_binder.h - Plan steps and callbacks as hooks -*- C++ -*-===//
//
// Registers what a model runs at its locations: plan steps (checked against the
// model first: location, heads, modules, dtype, width), the API's saves and
// callbacks. plan_binder.cpp holds the one table from a runtime::Action to how
// a step of it is checked, described and run at a visit; nothing else in
// program/ switches on an action.
//
// Hooks keep what they need (the saved-value store, the generation step, the
// callers) through shared pointers, so they outlive a moved model's members.
// Every registration is described to the rank agreement, in order.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/head_layout.h"
#include "program/rank_agreement.h"
#include "program/rank_program.h"
#include "program/saved_values.h"
#include "program/width_probe.h"
#include "runtime/intervention_runtime.h"
#include "runtime/plan.h"
#include "runtime/rank_context.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace frag::program {

/// What hooks read and write while a forward runs; the model reads it between forwards.
struct VisitState {
  SavedValues saved;
  int64_t generation_step = 0;  ///< which plan steps with "steps" act (0: a prefill or a plain forward)
  /// The stable id of each row of the batch a forward runs (program/decoder.h: ids do not shift when a
  /// row is dropped; -1 for a padding row), which a plan step's "rows" name; empty: "rows" are indices
  /// into the batch (a plain forward).
  std::vector<int64_t> row_ids;
  /// The rows that are real while a decode step runs padded to a batch bucket (program/decoder.h): plan
  /// steps and callbacks see rows [0, real_rows) only, so a value shaped per row ([rows, ...]) binds to
  /// the real rows and no step touches a padding row. nullopt: every row is real.
  std::optional<int64_t> real_rows;
};

struct BoundStep;

class PlanBinder {
 public:
  PlanBinder(std::shared_ptr<RankProgram> program, std::shared_ptr<runtime::RankContext> context,
             std::shared_ptr<runtime::InterventionRuntime> runtime);

  /// The id of a location a step or hook may act at (fragmented or whole); else frag::Error starting
  /// with `what`, which for a rank-local location says where its whole is, if anywhere.
  ir::LocationId checked_location(const std::string& location, const std::string& what) const;
  /// The attention heads on a location's last dim (ir/head_layout.h).
  ir::HeadLayout head_layout(const std::string& location) const;

  /// Checks every step of `plan`, then registers them all: a bad step fails before anything is
  /// registered. "segment"/"heads" become indices. Steps at whole locations of unknown width are
  /// checked before the next forward (widths()).
  void bind(const runtime::Plan& plan);
  /// Saves the whole at `location` under `name` on every visit (or one).
  void save(ir::LocationId location, const std::string& name, std::optional<int64_t> visit);
  /// A callback: the forward calls back into it, so no CUDA graph may hold it.
  void on(ir::LocationId location, runtime::Hook hook, std::optional<int64_t> visit, const std::string& label,
          bool edits);
  /// Removes every hook and pending check.
  void clear();

  /// Whether every hook only enqueues device work (no callback, no host-side step filter).
  bool capturable() const { return callbacks_ == 0; }
  /// Whether anything is registered (what a forward does then depends on the batch's real rows).
  bool has_hooks() const { return !bound_.empty() || callbacks_ > 0; }
  /// The values edit steps made on the device: a CUDA graph that reads them keeps them.
  std::vector<torch::Tensor> device_values() const;
  /// Hooks registered for a visit the last forward never reached, one line each.
  std::vector<std::string> unreached_visits() const;

  VisitState& state() { return *state_; }
  const VisitState& state() const { return *state_; }
  RankAgreement& agreement() { return agreement_; }
  WholeWidths& widths() { return widths_; }

 private:
  const ir::LocationTable& locations() const { return *program_->locations(); }
  void check_step(runtime::PlanStep& step, ir::LocationId id, const std::string& where, const std::string& prefix);
  void bind_step(const runtime::PlanStep& step, ir::LocationId location, std::string where);
  /// `capturable`: the hook only enqueues device work, so a CUDA graph may hold it.
  void add_hook(ir::LocationId location, runtime::Hook hook, std::optional<int64_t> visit, const std::string& label,
                bool edits, bool capturable);

  std::shared_ptr<RankProgram> program_;
  std::shared_ptr<runtime::RankContext> context_;
  std::shared_ptr<runtime::InterventionRuntime> runtime_;
  std::shared_ptr<VisitState> state_ = std::make_shared<VisitState>();
  RankAgreement agreement_;
  WholeWidths widths_;
  std::vector<std::shared_ptr<BoundStep>> bound_;  ///< the plan steps registered
  /// (location, visit) of every hook registered for one visit only.
  std::vector<std::pair<ir::LocationId, int64_t>> single_visits_;
  int64_t callbacks_ = 0;  ///< hooks registered that are not capturable
};

}  // namespace frag::program
