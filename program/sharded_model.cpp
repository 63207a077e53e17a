//===- program/sharded_model.cpp - The C++ API: one rank of a sharded model ===//
#include "program/sharded_model.h"

#include "ir/error.h"
#include "program/decoder.h"
#include "program/pt2_nativert_program.h"
#include "runtime/rank_module.h"

namespace frag::program {

torch::Tensor token_ids_on(const torch::Tensor& ids, const torch::Device& device, const std::string& what) {
  if (ids.device() == device && ids.scalar_type() == torch::kLong) return ids;  // every forward: no copy
  if (!c10::isIntegralType(ids.scalar_type(), /*includeBool=*/false))
    fail("{}: token ids must be integers, got {}", what, c10::toString(ids.scalar_type()));
  return ids.to(device, torch::kLong);
}

ShardedModel ShardedModel::load(std::shared_ptr<RankContext> context, const std::string& path,
                                const torch::Device& device, const std::string& rules_file) {
  if (runtime::is_torch_export_archive(path))
    return over(context, Pt2NativeRtProgram::load(*context, path, device, rules_file));
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
  model.binder_ = std::make_unique<PlanBinder>(model.program_, model.context_, model.runtime_);
  model.device_ = model.program_->device();
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
  return binder_->head_layout(location);
}

void ShardedModel::on(const std::string& location, Hook hook, std::optional<int64_t> visit,
                      const std::string& label, bool edits) {
  binder_->on(binder_->checked_location(location, label), std::move(hook), visit, label, edits);
}

void ShardedModel::save(const std::string& location, const std::string& name, std::optional<int64_t> visit) {
  binder_->save(binder_->checked_location(location, "save:" + name), name, visit);
}

void ShardedModel::apply(const Plan& plan) { binder_->bind(plan); }

void ShardedModel::set_plan(const Plan& plan) {
  std::string text;
  for (const auto& step : plan.steps) text += step.describe() + "\n";
  if (set_plan_at_changes_ == runtime_->changes() && text == set_plan_text_) return;
  clear();
  apply(plan);  // checks every step before registering any: a bad plan leaves nothing registered
  set_plan_text_ = std::move(text);
  set_plan_at_changes_ = runtime_->changes();
}

int64_t ShardedModel::registration_changes() const { return runtime_->changes(); }

void ShardedModel::clear() { binder_->clear(); }

std::vector<std::string> ShardedModel::unreached_visits() const { return binder_->unreached_visits(); }

void ShardedModel::prepare_forward(const torch::Tensor& input_ids) {
  if (!binder_->agreement().agreed()) binder_->agreement().agree(*context_, table());
  if (binder_->widths().pending()) binder_->widths().check_pending(*program_, context_, input_ids);
}

torch::Tensor ShardedModel::forward(const torch::Tensor& ids) {
  const torch::Tensor input_ids = token_ids_on(ids, device_, program_->path());
  prepare_forward(input_ids);
  runtime::ScopedRankContext rank_scope(context_);
  runtime::ScopedInterventionRuntime runtime_scope(runtime_);
  runtime_->begin_forward();
  const auto* kept = kept_locations();
  if (auto* entry = graph_entry(input_ids)) return run_captured(*entry, input_ids, kept, nullptr);
  return program_->forward(input_ids, kept, RankProgram::Use::kRepeated);
}

torch::Tensor ShardedModel::forward_cached(const torch::Tensor& ids, const CachedStep& step) {
  const torch::Tensor input_ids = token_ids_on(ids, device_, program_->path());
  if (!program_->has_kv_cache())
    fail("{}: this rank file's forward takes no KV cache (exported before cached generation, or a .pt2 archive "
         "exported without kv_cache=True); export it again with the kit to decode from a cache",
         program_->path());
  prepare_forward(input_ids.narrow(0, 0, 1));
  runtime::ScopedRankContext rank_scope(context_);
  runtime::ScopedInterventionRuntime runtime_scope(runtime_);
  runtime_->begin_forward();
  const auto* kept = kept_locations();
  // A decode step over the whole cache (program/decoder.h on a GPU) has the same shapes every step: it
  // replays a CUDA graph as a forward does; a prefill or a step over a growing prefix runs eagerly.
  if (step.cache_len == step.kv_cache.size(4))
    if (auto* entry = graph_entry(input_ids, &step)) return run_captured(*entry, input_ids, kept, &step);
  return program_->forward_cached(input_ids, step, kept);
}

void ShardedModel::set_cuda_graphs(bool on) {
  cuda_graphs_ = on;
  if (!on) graphs_->clear();
}

CapturedForwards::Entry* ShardedModel::graph_entry(const torch::Tensor& input_ids, const CachedStep* cached) {
  if (!cuda_graphs_ || !binder_->capturable() || !input_ids.is_cuda()) return nullptr;
  const void* weights = program_->capturable_weights();
  if (weights == nullptr || !context_->capturable()) return nullptr;
  CapturedForwards::Key key;
  key.plan = binder_->agreement().plan_digest();  // made once per change of plan
  key.specialize = specialize_;
  if (cached != nullptr) {
    key.decode = true;
    key.cache = cached->kv_cache.data_ptr();
    key.cache_rows = cached->kv_cache.size(2);
    key.cache_len = cached->cache_len;
    if (binder_->has_hooks()) key.real_rows = binder_->state().real_rows.value_or(0);
  }
  return &graphs_->entry(key, weights, input_ids);
}

torch::Tensor ShardedModel::run_captured(CapturedForwards::Entry& entry, const torch::Tensor& input_ids,
                                         const std::vector<ir::LocationId>* kept, const CachedStep* cached) {
  const CapturedForwards::Forward forward{
      [&](const torch::Tensor& ids, const torch::Tensor& positions) {
        if (cached == nullptr) return program_->forward(ids, kept, RankProgram::Use::kRepeated);
        CachedStep step = *cached;
        step.positions = positions;
        return program_->forward_cached(ids, step, kept);
      },
      *runtime_,
      *context_,
      binder_->state().saved,
      [this] { return binder_->device_values(); },
      program_->path()};
  return graphs_->run(entry, input_ids, cached ? cached->positions : torch::Tensor(), forward);
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
  return program::generate(*this, token_ids_on(input_ids, device_, program_->path()), steps);
}

}  // namespace frag::program
