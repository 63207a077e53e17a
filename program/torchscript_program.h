//===- program/torchscript_program.h - A TorchScript rank file as a program -*- C++ -*-===//
//
// Prepares a .pt rank file (program/prepared_rank.h: load, check across
// ranks, rewrite a plain export, bind ids) and runs it with LibTorch. A
// forward keeping only some locations' ops runs a specialized copy of the
// graph (program/forward_cache.h).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "program/forward_cache.h"
#include "program/prepared_rank.h"
#include "program/rank_program.h"

#include <memory>
#include <optional>
#include <string>

namespace frag::program {

class TorchScriptProgram : public RankProgram {
 public:
  /// Loads this rank's file onto `device` (prepare_rank: every rank fails alike).
  static std::shared_ptr<TorchScriptProgram> load(runtime::RankContext& context, const std::string& path,
                                                  const torch::Device& device, const std::string& rules_file = "");

  torch::jit::Module& module() { return prepared_.rank.module; }
  /// The graph forward runs for `kept` (nullptr: the full rewrite), for inspection.
  std::shared_ptr<torch::jit::Graph> forward_graph(const std::vector<ir::LocationId>* kept);

  at::ScalarType dtype() const override;
  torch::Device device() const override;
  const void* capturable_weights() const override;
  std::vector<std::pair<std::string, std::string>> named_modules() const override;
  torch::Tensor forward(const torch::Tensor& input_ids, const std::vector<ir::LocationId>* kept,
                        Use use) override;
  bool has_kv_cache() const override;
  std::vector<int64_t> kv_cache_shape(int64_t max_batch, int64_t max_len) const override;
  int64_t max_positions() const override;
  torch::Tensor forward_cached(const torch::Tensor& input_ids, const CachedStep& step,
                               const std::vector<ir::LocationId>* kept) override;

  std::optional<Arity> forward_arity(const std::string& path) const override { return modules_.forward_arity(path); }
  std::map<std::string, int64_t> int_attributes(const std::string& path) const override {
    return modules_.int_attributes(path);
  }
  torch::Tensor run(const std::string& path, const std::vector<torch::Tensor>& inputs) const override {
    return modules_.run(path, inputs);
  }

 private:
  explicit TorchScriptProgram(PreparedRank prepared);
  /// The module's first floating-point parameter: its dtype is the model's, its storage a graph's key.
  std::optional<torch::Tensor> first_weight() const;

  PreparedRank prepared_;
  runtime::ScriptModuleTree modules_;
  ForwardCache forwards_;
};

}  // namespace frag::program
