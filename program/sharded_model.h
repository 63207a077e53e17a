//===- program/sharded_model.h - The C++ API: one rank of a sharded model -*- C++ -*-===//
//
// For servers that load rewritten graphs in their own C++ process: load this
// rank's file (a plain export is rewritten in memory), register interventions
// or callbacks at locations, run forward or greedy generation, read the saved
// whole tensors. Every rank does the same calls in the same order.
//
//   auto context = RankContext::connect(RendezvousOptions::from_env());
//   auto model = ShardedModel::load(context, "rank" + std::to_string(context->rank()) + ".pt");
//   model.save("model.layers.0.mlp.down_proj.input", "down_in");
//   model.on("model.layers.1.output", [](torch::Tensor& whole, const VisitInfo&) {
//     whole.mul_(2);                  // edit in place …
//     return std::nullopt;            // … or return a replacement
//   });
//   auto logits = model.forward(ids);
//   torch::Tensor down_in = model.saved().at("down_in").at(0);   // whole, on every rank
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/head_layout.h"
#include "ir/location_table.h"
#include "program/captured_forwards.h"
#include "program/plan_binder.h"
#include "program/rank_program.h"
#include "program/saved_values.h"
#include "program/torchscript_program.h"
#include "runtime/ad_hoc_call.h"
#include "runtime/intervention_runtime.h"
#include "runtime/plan.h"
#include "runtime/rank_context.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace frag::program {

using runtime::Hook;
using runtime::InterventionRuntime;
using runtime::Plan;
using runtime::PlanStep;
using runtime::RankContext;
using runtime::VisitInfo;

/// What kind of location a name is.
using LocationKind = ir::LocationKind;

/// Token ids as a forward reads them: int64 on `device`. Ids elsewhere (a C++ caller's CPU ids for a CUDA
/// model) are moved there, other integer types widened; ids already right are returned as they are, so a
/// forward pays no copy. Floating-point "ids" are refused (`what` names the model in the message).
torch::Tensor token_ids_on(const torch::Tensor& ids, const torch::Device& device, const std::string& what);

/// One rank of a sharded model, with interventions.
class ShardedModel {
 public:
  /// Loads this rank's file onto `device` and checks it against the other
  /// ranks' files (one export, rank order). A plain export is rewritten in
  /// memory; `rules_file` declares extra layer classes (see frag inspect --rules).
  /// TorchScript files run with LibTorch; torch.export archives (.pt2) with
  /// NativeRT (program/pt2_nativert_program.h: CPU, no call wrappers).
  static ShardedModel load(std::shared_ptr<RankContext> context, const std::string& path,
                           const torch::Device& device = torch::kCPU, const std::string& rules_file = "");
  /// A model over a program prepared elsewhere (a .pt2 program run by Python).
  static ShardedModel over(std::shared_ptr<RankContext> context, std::shared_ptr<RankProgram> program);

  const ir::FragmentTable& table() const { return locations().fragments(); }
  const ir::LocationTable& locations() const { return *program_->locations(); }
  RankContext& context() const { return *context_; }
  InterventionRuntime& interventions() { return *runtime_; }
  const RankProgram& program() const { return *program_; }
  /// The TorchScript module; frag::Error for a program of another format.
  torch::jit::Module& module() { return torchscript("module()").module(); }

  /// Classifies a location name.
  LocationKind kind_of(const std::string& location) const;
  /// The attention heads on a location's last dim (ir/head_layout.h); empty where it has none.
  ir::HeadLayout head_layout(const std::string& location) const;

  /// Registers a callback. `label` describes it in the cross-rank check
  /// (ranks must register the same labels at the same locations).
  void on(const std::string& location, Hook hook, std::optional<int64_t> visit = std::nullopt,
          const std::string& label = "hook", bool edits = true);
  /// Saves the whole value at `location` under `name` on every visit (or one).
  void save(const std::string& location, const std::string& name, std::optional<int64_t> visit = std::nullopt);
  /// Registers every step of a plan, after checking it all (locations, indices,
  /// values' dtypes and widths); "segment"/"heads" become indices here. Whole locations have no width in the rule
  /// table: steps there are checked at the next forward, before it runs,
  /// against widths learned from one single-token forward with read-only
  /// hooks (every rank alike).
  void apply(const Plan& plan);
  /// Registers `plan` in place of everything registered: what a trace does before each forward. When
  /// it is the plan the last set_plan registered (the same steps, values alike byte for byte) and
  /// nothing was registered or cleared since, the registration stays as it is — its hooks, their
  /// values on the device, the ranks' agreement, its CUDA graph — so a plan repeated forward after
  /// forward costs what a plan registered once does. As with apply, a rank whose plan changed meets
  /// the others in the digest exchange before its next forward.
  void set_plan(const Plan& plan);
  /// Counts every change of what is registered: a caller that kept the count after registering its plan
  /// knows, while it is unchanged, that its plan is still what runs (so need not build and compare it again).
  int64_t registration_changes() const;
  /// Removes every intervention.
  void clear();

  /// The device the model loaded onto: forward, forward_cached and generate move ids there (token_ids_on).
  const torch::Device& device() const { return device_; }

  /// Runs forward(input_ids). Before the first forward after a change of
  /// interventions the ranks compare digests of their interventions and rule
  /// tables, and all refuse if any differs: no rank enters a collective another skips.
  /// It runs a copy of the rewritten graph that keeps the fragment ops only at
  /// locations with interventions (program/forward_cache); elsewhere the
  /// forward is the original export's, with no op to dispatch. See set_specialize.
  /// On a GPU a repeated forward replays a CUDA graph (set_cuda_graphs).
  torch::Tensor forward(const torch::Tensor& input_ids);
  /// Whether forward specializes the graph to the hooked locations or always
  /// runs the full rewrite (every location's ops, idle where nothing waits).
  /// On by default. Op by op (the runtime's forwards: runtime::set_gpu_fusion
  /// off, and LibTorch fuses nothing on CPUs) both compute bit-identical values;
  /// with GPU fusion allowed a fusion group may span a location whose ops were
  /// dropped, so a read-only plan could round differently from no plan.
  void set_specialize(bool specialize) { specialize_ = specialize; }
  /// Whether forwards on a GPU replay CUDA graphs (program/captured_forwards.h): a plan and input shape
  /// seen twice is captured on its third forward and replayed after, when nothing registered must call
  /// back (no on() hook). Replays compute what eager forwards do, bit for bit. On by default;
  /// turning it off drops the graphs. Weights must stay where they are while it is on (in-place changes
  /// are fine): replacing the first weight's storage (module().to(...)) drops the graphs, others are not watched.
  void set_cuda_graphs(bool on);
  bool cuda_graphs() const { return cuda_graphs_; }
  /// Captures, replays and refused captures so far.
  const CapturedForwards::Stats& graph_stats() const { return graphs_->stats(); }
  /// The graph the next forward runs (specialized or the full rewrite), for inspection.
  std::shared_ptr<torch::jit::Graph> forward_graph();

  /// Greedy decoding of `steps` tokens; interventions apply at every step (a plan step's "steps" and
  /// "rows" narrow that) and saves are keyed "step{k}.{name}". Returns the tokens, input included.
  /// A rank file whose forward takes a KV cache decodes from one (program/decoder.h: a prefill, then
  /// one token per step); older files recompute the whole sequence each step.
  torch::Tensor generate(const torch::Tensor& input_ids, int64_t steps);

  /// One forward of cached generation: forward(input_ids, positions, kv_cache, cache_len) with the
  /// interventions, as forward runs them (no CUDA graph). program/decoder.h drives it.
  torch::Tensor forward_cached(const torch::Tensor& input_ids, const CachedStep& step);
  /// Generation step the next forwards belong to: which plan steps with "steps" act at, and the step
  /// their saves are keyed by ("step3.name"). nullopt: a plain forward (step 0, saves keyed "name").
  /// Set by program/decoder.h.
  void set_generation_step(std::optional<int64_t> step) {
    binder_->state().generation_step = step.value_or(0);
    binder_->state().saved.set_step(step);
  }
  /// The batch's real rows while a decode step runs padded to a batch bucket: plan steps, callbacks and
  /// saves see those rows only (program/decoder.h). nullopt: every row is real.
  void set_real_rows(std::optional<int64_t> rows) {
    binder_->state().real_rows = rows;
    binder_->state().saved.set_rows(rows);
  }
  /// The stable ids of the rows of the batch the next forwards run (program/decoder.h), which a plan
  /// step's "rows" name; {}: "rows" are batch indices.
  void set_row_ids(std::vector<int64_t> ids) { binder_->state().row_ids = std::move(ids); }

  /// Runs modules ad hoc on a whole tensor (a logit lens: {"model.norm",
  /// "lm_head"}) and returns the whole result. Every rank must call it alike.
  torch::Tensor call(const std::vector<std::string>& paths, const torch::Tensor& whole);
  /// Runs one module on whole tensors (e.g. a FusedMoE with its router_logits).
  torch::Tensor call_module(const std::string& path, const std::vector<torch::Tensor>& wholes);
  /// The call wrappers of this model.
  runtime::AdHocCaller caller() const { return runtime::AdHocCaller(*program_, locations()); }

  /// Hooks registered for a visit that the last forward never reached ("visit 3 at X, which was
  /// visited 1 time"), one line each: a plan that silently did nothing is worth a warning.
  std::vector<std::string> unreached_visits() const;

  /// Saved tensors accumulate over forwards (generate keys them by step) until clear_saved().
  const SavedTensors& saved() const { return binder_->state().saved.view(); }
  void clear_saved() { binder_->state().saved.clear(); }

 private:
  ShardedModel() = default;
  /// What every forward does first: the ranks' agreement after a change, deferred width checks.
  void prepare_forward(const torch::Tensor& input_ids);
  /// The cache entry when this forward may use a CUDA graph, else nullptr.
  /// `cached`: a decode step's entry, keyed also by its cache (nullptr for a forward).
  CapturedForwards::Entry* graph_entry(const torch::Tensor& input_ids, const CachedStep* cached = nullptr);
  /// Runs `entry` (program/captured_forwards.h) on the program's forward, or its cached forward.
  torch::Tensor run_captured(CapturedForwards::Entry& entry, const torch::Tensor& input_ids,
                             const std::vector<ir::LocationId>* kept, const CachedStep* cached);
  /// The locations whose ops the next forward keeps: nullptr for all (the full rewrite).
  const std::vector<ir::LocationId>* kept_locations();
  TorchScriptProgram& torchscript(const char* what);

  // Pointers: hooks and the binder hold on to these parts, and a model is returned by value.
  std::shared_ptr<RankContext> context_;
  std::shared_ptr<RankProgram> program_;
  std::shared_ptr<InterventionRuntime> runtime_;
  std::unique_ptr<PlanBinder> binder_;
  std::unique_ptr<CapturedForwards> graphs_ = std::make_unique<CapturedForwards>();
  torch::Device device_ = torch::kCPU;  ///< program_->device() once: it walks the parameters
  bool specialize_ = true;
  bool cuda_graphs_ = true;
  std::string set_plan_text_;  ///< the steps of the last set_plan, described
  int64_t set_plan_at_changes_ = -1;  ///< runtime_->changes() right after it registered them
  int64_t specialized_at_changes_ = -1;  ///< runtime_->changes() when `kept_` was taken
  std::vector<ir::LocationId> kept_;
};

}  // namespace frag::program
