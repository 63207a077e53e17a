//===- program/sharded_model.cpp - The C++ API: one rank of a sharded model ===//
#include "program/sharded_model.h"

#include "ir/digest.h"
#include "ir/error.h"
#include "ir/module_path.h"
#include "program/decoder.h"
#include "program/nativert_program.h"
#include "program/width_probe.h"
#include "runtime/rank_module.h"

#include <fmt/ranges.h>

#include <algorithm>

namespace frag::program {
namespace {

using runtime::Action;

/// Applies an edit step to the selected part of a whole: the one switch over edit actions. `value` keeps
/// the step's value on the whole's device and dtype, made on the first visit: later visits (and a CUDA
/// graph's capture, which cannot copy from host memory) reuse it.
void apply_edit(const PlanStep& step, torch::Tensor& target, const std::string& location, torch::Tensor& value) {
  switch (step.action) {
    case Action::kZero:
      target.zero_();
      return;
    case Action::kScale:
      target.mul_(step.by);
      return;
    case Action::kSet:
    case Action::kAdd: {
      if (!value.defined() || value.device() != target.device() || value.scalar_type() != target.scalar_type())
        value = step.value_tensor.to(target.device(), target.scalar_type());
      try {
        if (step.action == Action::kSet) target.copy_(value.expand_as(target));
        else target.add_(value.expand_as(target));
      } catch (const c10::Error&) {
        fail("{}: value {} of shape [{}] does not fit the selected whole of shape [{}]", location, step.value,
             fmt::join(value.sizes(), ", "), fmt::join(target.sizes(), ", "));
      }
      return;
    }
    case Action::kSave:
    case Action::kCall:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "apply_edit: not an edit action");
}

/// The rows a plan step names, as an index into dim 0 of `whole`; frag::Error past the batch.
torch::Tensor row_index(const PlanStep& step, const torch::Tensor& whole, const std::string& location) {
  if (whole.dim() == 0 || step.rows.back() >= whole.size(0))
    fail("{}: \"rows\" [{}] of a plan step at {}: the batch has {} rows", location, fmt::join(step.rows, ", "),
         step.at, whole.dim() == 0 ? 0 : whole.size(0));
  return torch::tensor(step.rows, torch::kLong).to(whole.device());
}

}  // namespace

ShardedModel ShardedModel::load(std::shared_ptr<RankContext> context, const std::string& path,
                                const torch::Device& device, const std::string& rules_file) {
  if (runtime::is_torch_export_archive(path))
    return over(context, NativeRtProgram::load(*context, path, device, rules_file));
  auto program = TorchScriptProgram::load(*context, path, device, rules_file);
  // GPUs too run the specialized copy (specialize_ starts true): the runtime's forwards compute op by op
  // (runtime::set_gpu_fusion), so no fusion group spans a dropped location.
  return over(std::move(context), std::move(program));
}

ShardedModel ShardedModel::over(std::shared_ptr<RankContext> context, std::shared_ptr<RankProgram> program) {
  ShardedModel model;
  model.context_ = std::move(context);
  model.program_ = std::move(program);
  model.runtime_ = std::make_shared<InterventionRuntime>(model.program_->locations());
  return model;
}

TorchScriptProgram& ShardedModel::torchscript(const char* what) {
  auto* program = dynamic_cast<TorchScriptProgram*>(program_.get());
  if (program == nullptr)
    fail("{}: {} needs a TorchScript rank file; this model runs a torch.export program", program_->path(), what);
  return *program;
}

LocationKind ShardedModel::kind_of(const std::string& location) const { return locations().kind_of(location); }

ir::HeadLayout ShardedModel::head_layout(const std::string& location) const {
  // The layer's config lives in its module's integer attributes (head_size, total_num_heads, ...).
  return ir::head_layout(table(), location,
                         [this](const std::string& path) { return program_->int_attributes(path); });
}

ir::LocationId ShardedModel::checked_location(const std::string& location, const std::string& what) const {
  const ir::LocationId id = locations().id_of(location, what);
  const auto& entry = locations().at(id);
  if (entry.kind == LocationKind::kRankLocal) {
    // Where the rewrite saw this very value gathered (act_fn's output is down_proj's input), that location
    // holds its whole; the location it derives from (gate_up_proj's output) holds another value.
    std::string whole_at;
    for (const auto& local : table().rank_local)
      if (local.location == location) whole_at = local.whole_at;
    if (!whole_at.empty())
      fail("{}: {} is rank-local (derived from {}): no rank holds its whole value here; the same value is "
           "whole at {}: intervene there instead",
           what, location, entry.derived_from, whole_at);
    fail("{}: {} is rank-local (derived from {}): no rank holds its whole value; intervene at a fragmented "
         "location (`frag inspect` lists them), e.g. the input of the parallel layer it flows into",
         what, location, entry.derived_from);
  }
  return id;
}

void ShardedModel::add_hook(ir::LocationId location, Hook hook, std::optional<int64_t> visit,
                            const std::string& label, bool edits, bool capturable) {
  runtime_->add(location, std::move(hook), visit, edits);
  if (!capturable) ++callbacks_;
  if (visit) single_visits_.emplace_back(location, *visit);
  descriptors_.push_back(
      fmt::format("{}@{}#{}", label, locations().at(location).name, visit ? std::to_string(*visit) : "*"));
  agreed_ = false;
}

void ShardedModel::on(const std::string& location, Hook hook, std::optional<int64_t> visit,
                      const std::string& label, bool edits) {
  add_hook(checked_location(location, label), std::move(hook), visit, label, edits, /*capturable=*/false);
}

void ShardedModel::save(const std::string& location, const std::string& name, std::optional<int64_t> visit) {
  add_save(checked_location(location, "save:" + name), name, visit, std::nullopt);
}

void ShardedModel::add_save(ir::LocationId location, const std::string& name, std::optional<int64_t> visit,
                            const std::optional<runtime::WholeIndex>& index) {
  add_hook(
      location,
      [this, name, index](torch::Tensor& whole, const VisitInfo& info) -> std::optional<torch::Tensor> {
        if (index)  // a copy of the slice alone, not a view that keeps the whole alive
          keep_saved(name, index->select(whole.detach(), info.location).clone(at::MemoryFormat::Contiguous));
        else  // a gathered whole that nothing edits after this save is kept as is: no copy
          keep_saved(name, info.may_keep ? whole.detach() : whole.detach().clone());
        return std::nullopt;
      },
      visit, index ? fmt::format("save:{}[{}]", name, index->text) : "save:" + name, /*edits=*/false,
      /*capturable=*/true);
}

void ShardedModel::keep_saved(const std::string& name, torch::Tensor value) {
  if (capturing_ != nullptr) capturing_->saves.emplace_back(name, std::move(value));  // a buffer of the graph
  else saved_[save_prefix_ + name].push_back(std::move(value));
}

void ShardedModel::check_against_width(const PlanStep& step, int64_t width, const std::string& where) const {
  if (step.index) step.index->check_last_dim(width, where);
  if (step.action == Action::kCall) {
    const int64_t expected = caller().expected_input_width(step.modules.front());
    if (expected > 0 && width != expected)
      fail("{}: {} takes a whole input of width {}, but {} is {} wide", where, step.modules.front(), expected, step.at,
           width);
  }
  if (step.value_tensor.defined() && step.value_tensor.dim() > 0) {
    // Only an index that ends on the last dim (one item, or "...," first) says which part of it is selected.
    const bool last_dim_indexed = !step.index || step.index->items.size() == 1 ||
                                  step.index->items.front().kind == runtime::IndexItem::Kind::kEllipsis;
    if (!last_dim_indexed) return;
    const int64_t selected = step.index ? step.index->select(torch::empty({width}), step.at).size(-1) : width;
    const int64_t last = step.value_tensor.size(-1);
    if (last != 1 && last != selected)
      fail("{}: value {} has last dim {}, but the selected whole has width {}", where, step.value, last, selected);
  }
}

void ShardedModel::apply(const Plan& plan) {
  // Check everything first: a bad step must fail before anything is registered or run.
  const auto dtype = program_->dtype();
  std::vector<WidthCheck> later;
  std::vector<ir::LocationId> ids;
  std::vector<PlanStep> steps = plan.steps;  // resolved against this model: "segment"/"heads" become indices
  for (size_t i = 0; i < steps.size(); ++i) {
    auto& step = steps[i];
    const std::string where =
        fmt::format("{}: intervention {} ({} at {})", plan.source, i, runtime::action_name(step.action), step.at);
    const ir::LocationId id = checked_location(step.at, where);
    ids.push_back(id);
    runtime::resolve_heads(step, head_layout(step.at), fmt::format("{}: intervention {}: ", plan.source, i));
    if (step.action == Action::kCall) {
      if (step.modules.empty()) fail("{}: \"modules\" is empty", where);
      auto calls = caller();
      for (const auto& path : step.modules) {
        try {
          calls.check_callable(path);
        } catch (const Error& e) {
          fail("{}: {}", where, e.what());
        }
      }
    }
    if (step.value_tensor.defined() && step.value_tensor.scalar_type() != dtype)
      fail("{}: value {} is {}, but the model computes in {}", where, step.value,
           c10::toString(step.value_tensor.scalar_type()), c10::toString(dtype));
    const bool needs_width =
        step.index || step.action == Action::kCall || (step.value_tensor.defined() && step.value_tensor.dim() > 0);
    if (!needs_width) continue;
    if (auto width = whole_width_at(id)) check_against_width(step, *width, where);
    else later.push_back({step, id, where});  // a whole location not yet seen: checked before the next forward
  }
  for (size_t i = 0; i < steps.size(); ++i)
    register_step(steps[i], ids[i],
                  fmt::format("{}: intervention {} ({} at {})", plan.source, i, runtime::action_name(steps[i].action),
                              steps[i].at));
  width_checks_.insert(width_checks_.end(), later.begin(), later.end());
}

std::optional<int64_t> ShardedModel::whole_width_at(ir::LocationId location) const {
  const auto& side = locations().at(location).side;
  if (side && side->whole_width) return *side->whole_width;
  if (auto it = probed_widths_.find(location); it != probed_widths_.end()) return it->second;
  return std::nullopt;
}

void ShardedModel::check_widths_at_whole_locations(const torch::Tensor& input_ids) {
  // The checks stay pending until they pass: a retry fails again.
  std::vector<ir::LocationId> probed;
  for (const auto& check : width_checks_) probed.push_back(check.location);
  for (const auto& [id, width] : probe_widths(*program_, context_, probed, input_ids)) probed_widths_.emplace(id, width);
  // A location the probe did not reach (an expert no token was routed to, a
  // branch on length) is checked when first visited, on every rank alike.
  for (const auto& check : width_checks_)
    if (auto width = whole_width_at(check.location)) check_against_width(check.step, *width, check.where);
  width_checks_.clear();
}

void ShardedModel::register_step(const PlanStep& step, ir::LocationId location, const std::string& where) {
  if (!step.steps.empty() || !step.rows.empty()) return register_filtered_step(step, location, where);
  switch (step.action) {
    case Action::kSave:
      add_save(location, step.as, step.visit, step.index);
      return;
    case Action::kCall:
      add_hook(
          location,
          [this, step, where](torch::Tensor& whole, const VisitInfo&) -> std::optional<torch::Tensor> {
            torch::Tensor result;
            try {
              result = caller().call(*context_, step.modules, whole);
            } catch (const Error& e) {  // a chain in the wrong order, say: name the step
              fail("{}: {}", where, e.what());
            }
            keep_saved(step.as, result);
            return std::nullopt;
          },
          // The chain only enqueues GPU work (its modules' kernels, their collectives): a graph holds it.
          step.visit, fmt::format("call:{}", step.describe()), /*edits=*/false, /*capturable=*/true);
      return;
    case Action::kSet:
    case Action::kAdd:
    case Action::kScale:
    case Action::kZero:
      add_hook(
          location,
          [this, step, value = std::make_shared<torch::Tensor>()](
              torch::Tensor& whole, const VisitInfo& info) -> std::optional<torch::Tensor> {
            torch::Tensor target = step.index ? step.index->select(whole, info.location) : whole;
            apply_edit(step, target, info.location, *value);
            // A graph replays reading this value where it is: it keeps it alive, whatever becomes of the hook.
            if (capturing_ != nullptr && value->defined()) capturing_->held.push_back(*value);
            return std::nullopt;
          },
          step.visit, fmt::format("edit:{}", step.describe()), /*edits=*/true, /*capturable=*/true);
      return;
  }
}

void ShardedModel::register_filtered_step(const PlanStep& step, ir::LocationId location, const std::string& where) {
  // Acts at some generation steps or rows only: the hook decides on the host at each visit, so no CUDA
  // graph may hold it (capturable false).
  const bool edit = runtime::edits(step.action);
  add_hook(
      location,
      [this, step, where, value = std::make_shared<torch::Tensor>()](
          torch::Tensor& whole, const VisitInfo& info) -> std::optional<torch::Tensor> {
        if (!step.acts_at(generation_step_)) return std::nullopt;
        torch::Tensor rows = step.rows.empty() ? torch::Tensor() : row_index(step, whole, info.location);
        torch::Tensor part = rows.defined() ? whole.index_select(0, rows) : whole;  // a copy where rows
        if (step.action == Action::kSave) {
          auto target = step.index ? step.index->select(part.detach(), info.location) : part.detach();
          keep_saved(step.as, target.clone(at::MemoryFormat::Contiguous));
          return std::nullopt;
        }
        if (step.action == Action::kCall) {
          torch::Tensor result;
          try {
            result = caller().call(*context_, step.modules, part);
          } catch (const Error& e) {
            fail("{}: {}", where, e.what());
          }
          keep_saved(step.as, result);
          return std::nullopt;
        }
        torch::Tensor target = step.index ? step.index->select(part, info.location) : part;
        apply_edit(step, target, info.location, *value);
        if (rows.defined()) whole.index_copy_(0, rows, part);
        return std::nullopt;
      },
      step.visit, fmt::format("{}:{}", edit ? "edit" : "save", step.describe()), edit, /*capturable=*/false);
}

void ShardedModel::set_plan(const Plan& plan) {
  std::string text;
  for (const auto& step : plan.steps) text += step.describe() + "\n";
  if (set_plan_at_changes_ == runtime_->changes() && text == set_plan_text_) return;
  clear();
  apply(plan);  // checks every step before registering any: a bad plan leaves nothing registered
  set_plan_text_ = std::move(text);
  set_plan_at_changes_ = runtime_->changes();
}

void ShardedModel::clear() {
  runtime_->clear();
  callbacks_ = 0;
  width_checks_.clear();
  descriptors_.clear();
  single_visits_.clear();
  agreed_ = false;
}

std::vector<std::string> ShardedModel::unreached_visits() const {
  std::vector<std::string> lines;
  for (const auto& [id, visit] : single_visits_) {
    const std::string& name = locations().at(id).name;
    const int64_t visits = runtime_->visits_at(name);
    if (visit >= visits)
      lines.push_back(fmt::format("visit {} at {} was never reached: the last forward visited it {} time{}", visit,
                                  name, visits, visits == 1 ? "" : "s"));
  }
  return lines;
}

void ShardedModel::agree_on_interventions() {
  // In registration order: hooks at one location run in that order, so it is part of the plan.
  if (table_digest_.empty()) table_digest_ = fmt::format("{:016x}", ir::fnv1a(ir::to_json(table()).dump()));
  const std::string mine = fmt::format("{:016x}", ir::fnv1a(plan_text() + "\n" + table_digest_));
  std::vector<std::string> all;
  try {
    all = context_->exchange(fmt::format("interventions/{}", exchanges_++), mine);
  } catch (const Error& e) {
    fail("{} (ranks compare plans before the first forward after a change of plan; a rank whose plan did not "
         "change since its last forward does not: every rank must change its plan alike)",
         e.what());
  }
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r] != all[0])
      fail("ranks hold different interventions or rule tables (digest {} on rank 0, {} on rank {}): every "
           "rank must load the same plan and files of one export; nothing was run",
           all[0], all[r], r);
  agreed_ = true;
}

torch::Tensor ShardedModel::forward(const torch::Tensor& input_ids) {
  if (!agreed_) agree_on_interventions();
  if (!width_checks_.empty()) check_widths_at_whole_locations(input_ids);
  runtime::ScopedRankContext rank_scope(context_);
  runtime::ScopedInterventionRuntime runtime_scope(runtime_);
  runtime_->begin_forward();
  const auto* kept = kept_locations();
  if (auto* entry = graph_entry(input_ids)) return forward_with_graph(*entry, input_ids, kept);
  return program_->forward(input_ids, kept, RankProgram::Use::kRepeated);
}

void ShardedModel::set_cuda_graphs(bool on) {
  cuda_graphs_ = on;
  if (!on) graphs_.clear();
}

CapturedForwards::Entry* ShardedModel::graph_entry(const torch::Tensor& input_ids, const CachedStep* cached) {
  if (!cuda_graphs_ || callbacks_ > 0 || !input_ids.is_cuda()) return nullptr;
  const void* weights = program_->capturable_weights();
  if (weights == nullptr || !context_->capturable()) return nullptr;
  if (cached == nullptr) return &graphs_.entry(plan_text(), specialize_, weights, input_ids);
  // A decode step reads and writes its cache where it is: the graph is that cache's (and that length's).
  return &graphs_.entry(fmt::format("{}\ndecode:{}:{}:{}", plan_text(), cached->kv_cache.data_ptr(),
                                    cached->kv_cache.size(2), cached->cache_len),
                        specialize_, weights, input_ids);
}

torch::Tensor ShardedModel::run_program(const torch::Tensor& input_ids, const std::vector<ir::LocationId>* kept,
                                        const CachedStep* cached, const torch::Tensor& positions) {
  if (cached == nullptr) return program_->forward(input_ids, kept, RankProgram::Use::kRepeated);
  CachedStep step = *cached;
  step.positions = positions;
  return program_->forward_cached(input_ids, step, kept);
}

const std::string& ShardedModel::plan_text() {
  if (plan_text_at_changes_ != runtime_->changes()) {
    plan_text_ = fmt::format("{}", fmt::join(descriptors_, "\n"));
    plan_text_at_changes_ = runtime_->changes();
  }
  return plan_text_;
}

torch::Tensor ShardedModel::forward_with_graph(CapturedForwards::Entry& entry, const torch::Tensor& input_ids,
                                               const std::vector<ir::LocationId>* kept, const CachedStep* cached) {
  const torch::Tensor positions = cached ? cached->positions : torch::Tensor();
  if (!entry.captured()) {
    if (entry.refused || entry.eager_runs < CapturedForwards::kEagerRunsFirst) {
      ++entry.eager_runs;
      return run_program(input_ids, kept, cached, positions);
    }
    capture(entry, input_ids, kept, cached);
    if (!entry.captured()) return run_program(input_ids, kept, cached, positions);
  }
  entry.input.copy_(input_ids);
  if (cached) entry.positions.copy_(positions);
  entry.graph->replay();
  ++graphs_.stats().replays;
  runtime_->replayed(entry.counts);
  for (const auto& [name, buffer] : entry.saves) keep_saved(name, buffer.clone());
  auto logits = entry.output.clone();
  try {
    // As an eager forward ends: one wait for the collectives, which throws what failed or timed out.
    context_->watch_replay();
    context_->synchronize();
  } catch (const Error& e) {
    fail("{}: forward failed: {}", program_->path(), e.what());
  }
  return logits;
}

void ShardedModel::capture(CapturedForwards::Entry& entry, const torch::Tensor& input_ids,
                           const std::vector<ir::LocationId>* kept, const CachedStep* cached) {
  const auto before = runtime_->counts();
  entry.input = input_ids.clone();
  if (cached) entry.positions = cached->positions.clone();
  capturing_ = &entry;
  try {
    entry.graph = std::make_unique<runtime::CudaGraph>(
        [&] { entry.output = run_program(entry.input, kept, cached, entry.positions); });
  } catch (const Error& e) {
    capturing_ = nullptr;
    entry.saves.clear();
    entry.held.clear();
    entry.input = entry.output = entry.positions = torch::Tensor();
    entry.refused = e.what();
    ++graphs_.stats().refusals;
    if (context_->rank() == 0)
      fmt::print(stderr, "fragments: {}: input shape [{}] runs eagerly: {}\n", program_->path(),
                 fmt::join(entry.shape, ", "), e.what());
    runtime_->begin_forward();  // the eager forward that follows counts its own visits
    return;
  }
  capturing_ = nullptr;
  ++graphs_.stats().captures;
  auto after = runtime_->counts();
  for (size_t id = 0; id < after.collectives.size(); ++id) after.collectives[id] -= before.collectives[id];
  entry.counts = std::move(after);
  runtime_->begin_forward();  // the replay counts them
}

const std::vector<ir::LocationId>* ShardedModel::kept_locations() {
  if (!specialize_) return nullptr;
  if (runtime_->changes() != specialized_at_changes_) {
    kept_ = runtime_->hooked_locations();
    specialized_at_changes_ = runtime_->changes();
  }
  return &kept_;
}

std::shared_ptr<torch::jit::Graph> ShardedModel::forward_graph() {
  return torchscript("forward_graph()").forward_graph(kept_locations());
}

torch::Tensor ShardedModel::call(const std::vector<std::string>& paths, const torch::Tensor& whole) {
  return caller().call(*context_, paths, whole);
}

torch::Tensor ShardedModel::call_module(const std::string& path, const std::vector<torch::Tensor>& wholes) {
  return caller().call_module(*context_, path, wholes);
}

torch::Tensor ShardedModel::generate(const torch::Tensor& input_ids, int64_t steps) {
  if (program_->has_kv_cache()) {
    // One KV cache sized for this batch: a prefill and steps - 1 decode steps (program/decoder.h).
    Decoder decoder(*this, input_ids.size(0), input_ids.size(1) + steps);
    return decoder.generate(input_ids, steps);
  }
  torch::Tensor tokens = input_ids;
  for (int64_t s = 0; s < steps; ++s) {
    save_prefix_ = fmt::format("step{}.", s);
    auto logits = forward(tokens);
    auto next = logits.select(1, logits.size(1) - 1).argmax(-1, /*keepdim=*/true).to(tokens.dtype());
    tokens = torch::cat({tokens, next}, 1);
  }
  save_prefix_.clear();
  return tokens;
}

torch::Tensor ShardedModel::forward_cached(const torch::Tensor& input_ids, const CachedStep& step) {
  if (!program_->has_kv_cache())
    fail("{}: this rank file's forward takes no KV cache (exported before cached generation, or a .pt2 archive); "
         "export it again with the kit to decode from a cache",
         program_->path());
  if (!agreed_) agree_on_interventions();
  if (!width_checks_.empty()) check_widths_at_whole_locations(input_ids.narrow(0, 0, 1));
  runtime::ScopedRankContext rank_scope(context_);
  runtime::ScopedInterventionRuntime runtime_scope(runtime_);
  runtime_->begin_forward();
  const auto* kept = kept_locations();
  // A decode step over the whole cache (program/decoder.h on a GPU) has the same shapes every step: it
  // replays a CUDA graph as a forward does; a prefill or a step over a growing prefix runs eagerly.
  if (step.cache_len == step.kv_cache.size(4))
    if (auto* entry = graph_entry(input_ids, &step)) return forward_with_graph(*entry, input_ids, kept, &step);
  return program_->forward_cached(input_ids, step, kept);
}

}  // namespace frag::program
