//===- program/torchscript_program.cpp - A TorchScript rank file as a program ===//
#include "program/torchscript_program.h"

#include "runtime/cuda_graph.h"
#include "runtime/forward_arguments.h"

#include <torch/csrc/jit/api/function_impl.h>

namespace frag::program {

TorchScriptProgram::TorchScriptProgram(PreparedRank prepared)
    : RankProgram(prepared.rank.path, prepared.locations),
      prepared_(std::move(prepared)),
      modules_(prepared_.rank.module) {}

std::shared_ptr<TorchScriptProgram> TorchScriptProgram::load(runtime::RankContext& context, const std::string& path,
                                                             const torch::Device& device,
                                                             const std::string& rules_file) {
  return std::shared_ptr<TorchScriptProgram>(new TorchScriptProgram(prepare_rank(context, path, device, rules_file)));
}

std::optional<torch::Tensor> TorchScriptProgram::first_weight() const {
  for (const auto& p : prepared_.rank.module.parameters())
    if (p.is_floating_point()) return p;
  return std::nullopt;
}

at::ScalarType TorchScriptProgram::dtype() const {
  const auto weight = first_weight();
  return weight ? weight->scalar_type() : at::kFloat;
}

const void* TorchScriptProgram::capturable_weights() const {
  if (!runtime::CudaGraph::available()) return nullptr;
  const auto weight = first_weight();
  return weight && weight->is_cuda() ? weight->data_ptr() : nullptr;
}

std::vector<std::pair<std::string, std::string>> TorchScriptProgram::named_modules() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& item : prepared_.rank.module.named_modules()) {
    auto type = item.value.type()->name();
    out.emplace_back(item.name, type ? type->name() : std::string());
  }
  return out;
}

torch::Tensor TorchScriptProgram::forward(const torch::Tensor& input_ids, const std::vector<ir::LocationId>* kept,
                                          Use use) {
  if (kept == nullptr) return runtime::run_forward(prepared_.rank, input_ids);
  if (use == Use::kOnce) {
    // Its own copy, not the cache's: the forwards that repeat are optimized exactly as without it.
    auto once = forward_keeping(prepared_, *kept, "__torch__.frag.forward_once");
    return runtime::run_forward(prepared_.rank, input_ids, once.get());
  }
  return runtime::run_forward(prepared_.rank, input_ids, &forwards_.keeping(prepared_, *kept));
}

torch::Device TorchScriptProgram::device() const {
  auto weight = first_weight();
  return weight ? weight->device() : torch::Device(torch::kCPU);
}

bool TorchScriptProgram::has_kv_cache() const {
  return prepared_.rank.module.find_method("kv_cache_shape").has_value();
}

std::vector<int64_t> TorchScriptProgram::kv_cache_shape(int64_t max_batch, int64_t max_len) const {
  auto method = prepared_.rank.module.find_method("kv_cache_shape");
  if (!method) return {};
  return (*method)({max_batch, max_len}).toIntVector();
}

int64_t TorchScriptProgram::max_positions() const {
  auto method = prepared_.rank.module.find_method("max_positions");
  return method ? (*method)(std::vector<c10::IValue>{}).toInt() : 0;
}

torch::Tensor TorchScriptProgram::forward_cached(const torch::Tensor& input_ids, const CachedStep& step,
                                                 const std::vector<ir::LocationId>* kept) {
  std::vector<c10::IValue> extra{step.positions, step.kv_cache, step.cache_len};
  if (kept == nullptr) return runtime::run_forward_with(prepared_.rank, input_ids, extra);
  return runtime::run_forward_with(prepared_.rank, input_ids, extra, &forwards_.keeping(prepared_, *kept));
}

std::shared_ptr<torch::jit::Graph> TorchScriptProgram::forward_graph(const std::vector<ir::LocationId>* kept) {
  if (kept == nullptr) return torch::jit::toGraphFunction(module().get_method("forward").function()).graph();
  return forwards_.keeping(prepared_, *kept).graph();
}

}  // namespace frag::program
