//===- runtime/intervention_runtime.h - Once-per-visit interventions -*- C++ -*-===//
//
// Executes the frag::gather → frag::intervene → frag::split triples that the
// fragment pass inserts. Per visit of a location (one call of one module in
// one forward):
//   - gather runs a collective only when an intervention waits on this visit;
//     with nothing waiting the triple is a lookup: no collective, no copy;
//   - every waiting intervention sees the same whole tensor (one collective,
//     however many interventions);
//   - split hands the model back its own original piece when nothing was
//     edited (so reads are bit-identical to no intervention), else this rank's
//     piece of the edited whole (ir::piece_of_whole; for partial sums rank 0
//     takes the whole and the others -0.0, so the model's own all-reduce
//     returns the edited whole exactly).
// Whole locations have a lone frag::intervene, which opens the visit itself.
//
// The runtime is built over a location table (ir/location_table.h) and the ops
// reach it by location id (the graph is bound at load,
// passes/bind_location_ids): a visit indexes a vector, and each location's
// rule was parsed once, when the table was read.
//
// Interventions must behave the same on every rank (they see the same whole
// tensor): a hook that issues collectives under rank-dependent control flow
// deadlocks, as in any SPMD program.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/fragment_rule.h"
#include "ir/location_table.h"
#include "runtime/current.h"

#include <torch/types.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace frag::runtime {

/// What a hook learns about the visit it runs in.
struct VisitInfo {
  const std::string& location;
  int64_t visit;                    ///< 0 for a module's first call in this forward, 1 for its second, …
  const ir::FragmentRule* rule;     ///< nullptr at a whole location
  /// The hook may keep `whole` as it is, without a copy: it is the runtime's
  /// own fresh tensor (gathered, not the model's and not a replacement) and no
  /// hook after this one on this visit may change it. A save keeps it then.
  bool may_keep = false;
  ir::LocationId id = -1;
};

/// An intervention. It gets the whole tensor and may read it, edit it in
/// place, or return a replacement (same shape and dtype). Returning nullopt
/// means "no replacement" (in-place edits are still noticed).
using Hook = std::function<std::optional<torch::Tensor>(torch::Tensor& whole, const VisitInfo& visit)>;

/// Interventions of one rank and the per-forward visit state.
class InterventionRuntime {
 public:
  explicit InterventionRuntime(std::shared_ptr<const ir::LocationTable> locations);

  const ir::LocationTable& locations() const { return *locations_; }

  /// Registers `hook` at a location, on every visit or only visit `visit`.
  /// `edits`: the hook may change the tensor. At a whole location the hooks
  /// then work on a copy, so an edit reaches the module being called and not
  /// other users of the same value (a residual, say).
  void add(ir::LocationId location, Hook hook, std::optional<int64_t> visit = std::nullopt, bool edits = true);
  /// The same by name (frag::Error for a name the table does not list).
  void add(const std::string& location, Hook hook, std::optional<int64_t> visit = std::nullopt,
           bool edits = true);
  /// Removes every hook.
  void clear();
  /// Counts add() and clear() calls: a caller that specializes the graph to
  /// the hooked locations knows when to do it again.
  int64_t changes() const { return changes_; }
  /// Starts a forward: visit counters go back to 0.
  void begin_forward();

  /// Whether any hook waits at a location (on some visit).
  bool has_hooks_at(ir::LocationId location) const;
  /// Locations with hooks, by id (ascending).
  std::vector<ir::LocationId> hooked_locations() const;

  /// Collectives the triples at `location` ran (since construction).
  int64_t collectives_at(const std::string& location) const;
  /// Visits of `location` in the current forward (counted where ops run: a
  /// graph specialized to the hooked locations has none elsewhere).
  int64_t visits_at(const std::string& location) const;

  /// Per location id: visits in the current forward, and collectives since construction. A forward
  /// replayed from a CUDA graph runs no op: program/captured_forwards.h takes these around the captured
  /// forward and hands the difference to replayed(), so visits_at and collectives_at read as if it ran.
  struct Counts {
    std::vector<int64_t> visits;
    std::vector<int64_t> collectives;
  };
  Counts counts() const;
  /// Counts a replay of a forward that did `forward` (visits, and the collectives it added), after begin_forward.
  void replayed(const Counts& forward);

  // The op kernels (runtime/fragment_ops.cpp) call these with bound ids.
  torch::Tensor gather(const torch::Tensor& piece, ir::LocationId location);
  torch::Tensor intervene(const torch::Tensor& value, ir::LocationId location, bool fragmented);
  torch::Tensor split(const torch::Tensor& value, const torch::Tensor& piece, ir::LocationId location);

 private:
  struct Registered {
    std::optional<int64_t> visit;
    Hook hook;
    bool edits;
  };
  /// The state of one location, at its id. The per-forward part is reset
  /// lazily when a forward first visits it, so a forward allocates nothing here.
  struct Location {
    const ir::LocationEntry* entry = nullptr;
    std::vector<Registered> hooks;
    int64_t collectives = 0;  ///< since construction
    int64_t forward = -1;     ///< the forward the fields below belong to
    int64_t visits = 0;       ///< in that forward
    int64_t visit = -1;       ///< the open visit
    bool gathered = false;
    bool edited = false;
  };

  Location& state(ir::LocationId location);
  const Location* find(const std::string& location) const;
  /// The state with its per-forward part current.
  Location& in_this_forward(ir::LocationId location);
  static bool waiting(const Location& state, int64_t visit);
  static int64_t open_visit(Location& state);

  std::shared_ptr<const ir::LocationTable> locations_;
  std::vector<Location> states_;
  int64_t forward_ = 0;
  int64_t changes_ = 0;
};

/// The runtime the ops use on this thread: a thread-local one when set, else
/// the process-wide one, else none (then the triples pass values through).
inline InterventionRuntime* current_intervention_runtime() { return Current<InterventionRuntime>::get(); }
inline void set_process_intervention_runtime(std::shared_ptr<InterventionRuntime> runtime) {
  Current<InterventionRuntime>::set_process(std::move(runtime));
}
/// Makes a runtime current on this thread while it lives.
using ScopedInterventionRuntime = Current<InterventionRuntime>::Scope;

}  // namespace frag::runtime
