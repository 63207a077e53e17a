//===- runtime/ad_hoc_call.cpp - Run a parallel layer on whole tensors ---===//
#include "runtime/ad_hoc_call.h"

#include "ir/error.h"
#include "ir/module_path.h"
#include "runtime/rank_module.h"
#include "runtime/whole_value.h"

#include <fmt/ranges.h>

namespace frag::runtime {
namespace {

torch::Tensor main_output(const c10::IValue& output, const std::string& path) {
  if (output.isTensor()) return output.toTensor();
  if (output.isTuple() && !output.toTuple()->elements().empty() && output.toTuple()->elements()[0].isTensor())
    return output.toTuple()->elements()[0].toTensor();
  fail("{}: forward returned {}, not a tensor or (tensor, …)", path, output.tagKind());
}

}  // namespace

std::optional<ModuleTree::Arity> ScriptModuleTree::forward_arity(const std::string& path) const {
  auto method = ir::module_at(root_, path).find_method("forward");
  if (!method) return std::nullopt;
  Arity arity;
  for (const auto& argument : method->function().getSchema().arguments()) {
    if (argument.name() == "self") continue;
    ++arity.arguments;
    if (!argument.default_value()) ++arity.required;
  }
  return arity;
}

std::map<std::string, int64_t> ScriptModuleTree::int_attributes(const std::string& path) const {
  return ir::int_attributes_at(root_, path);
}

torch::Tensor ScriptModuleTree::run(const std::string& path, const std::vector<torch::Tensor>& inputs) const {
  auto module = ir::module_at(root_, path);
  std::vector<c10::IValue> values(inputs.begin(), inputs.end());
  torch::NoGradGuard no_grad;
  GpuFusionScope fusion(computes_in_half_precision(module));  // as in the forward (run_forward)
  return main_output(module.forward(values), path);
}

void AdHocCaller::check_callable(const std::string& path, size_t tensors) const {
  if (path.empty()) fail("an empty module path cannot be called");
  auto arity = modules_->forward_arity(path);
  if (!arity) fail("{} has no call wrapper: it has no forward method", path);
  if (arity->arguments < tensors || arity->required > tensors)
    fail("{} has no call wrapper for {} tensor(s): its forward takes {} argument(s), {} required", path, tensors,
         arity->arguments, arity->required);
  for (const auto& location : {ir::input_location(path), ir::output_location(path)})
    if (locations_->kind_of(location) == ir::LocationKind::kRankLocal)
      fail("{} has no call wrapper: {} is rank-local (derived from {}), so no whole value exists for it", path,
           location, locations_->at(*locations_->find(location)).derived_from);
}

int64_t AdHocCaller::expected_input_width(const std::string& path) const {
  if (const auto* layer = locations_->layer(path)) {
    if (layer->input && layer->input->whole_width) return *layer->input->whole_width;
    if (layer->kind == "VocabParallelEmbedding" || layer->kind == "LogitsProcessor") return 0;
    const auto attributes = modules_->int_attributes(path);
    for (const char* name : {"input_size", "embedding_dim", "hidden_size"})
      if (auto it = attributes.find(name); it != attributes.end()) return it->second;
  }
  return 0;
}

torch::Tensor AdHocCaller::call_module(RankContext& context, const std::string& path,
                                       const std::vector<torch::Tensor>& wholes) const {
  if (wholes.empty()) fail("{}: an ad-hoc call needs an input", path);
  check_callable(path, wholes.size());
  const torch::Tensor& whole = wholes[0];
  const int64_t width = expected_input_width(path);
  if (width > 0 && (whole.dim() == 0 || whole.size(-1) != width))
    fail("{}: an ad-hoc call needs a whole input of width {}, got shape [{}]", path, width,
         fmt::join(whole.sizes(), ", "));
  const ir::LayerEntry* layer = locations_->layer(path);
  std::vector<torch::Tensor> inputs(wholes);
  if (layer && layer->input)
    inputs[0] = piece_from_whole(layer->input->rule, whole, context.group(layer->input->rule.group).rank());
  ScopedRankContext scope(std::shared_ptr<RankContext>(&context, [](RankContext*) {}));
  torch::Tensor output = modules_->run(path, inputs);
  if (layer && layer->output)
    output = whole_from_piece(context.group(layer->output->rule.group), layer->output->rule, output,
                              ir::output_location(path));
  return output;
}

torch::Tensor AdHocCaller::call(RankContext& context, const std::vector<std::string>& paths,
                                const torch::Tensor& whole) const {
  if (paths.empty()) fail("an ad-hoc call needs at least one module");
  torch::Tensor value = whole;
  for (size_t i = 0; i < paths.size(); ++i) {
    // A module that cannot take what the one before it returned (a chain in the wrong order): say which
    // module of the chain, on what, instead of LibTorch's bare "The size of tensor a (1000) must match ...".
    const std::string input = i == 0 ? std::string("the whole value") : fmt::format("the output of {}", paths[i - 1]);
    try {
      value = call_module(context, paths[i], {value});
    } catch (const Error&) {
      throw;
    } catch (const c10::Error& e) {
      fail("calling {} (module {} of the chain {}) on {} of shape [{}] failed: {}", paths[i], i,
           fmt::join(paths, " -> "), input, fmt::join(value.sizes(), ", "), interpreter_message(e.what_without_backtrace()));
    } catch (const std::exception& e) {
      fail("calling {} (module {} of the chain {}) on {} of shape [{}] failed: {}", paths[i], i,
           fmt::join(paths, " -> "), input, fmt::join(value.sizes(), ", "), interpreter_message(e.what()));
    }
  }
  return value;
}

}  // namespace frag::runtime
