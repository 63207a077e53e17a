//===- program/pt2_nativert_program.h - A .pt2 rank file run by NativeRT in C++ -*- C++ -*-===//
//
// For frag run and the C++ API on torch.export archives, without Python:
// program/pt2_program.h prepares the archive (checks across ranks, rewrites
// a plain export in memory, indexes the table), passes/bind_location_ids
// binds its graph's fragment ops to the table's ids, and PyTorch's native
// runtime for exported programs (torch::nativert::ModelRunnerHandle) runs it.
//
// NativeRT runs the whole graph: every location's ops stay (idle ones are a
// lookup), and a module's own forward cannot be called alone, so call
// wrappers (a logit lens, a plan's "call" step) are refused in words here;
// the Python front end runs them on .pt2 (fragments.load).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "program/pt2_program.h"
#include "runtime/rank_context.h"

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch::nativert {
class ModelRunnerHandle;
}

namespace frag::program {

class Pt2NativeRtProgram : public Pt2Program {
 public:
  /// Prepares and loads this rank's .pt2 (CPU only); every rank fails alike.
  static std::shared_ptr<Pt2NativeRtProgram> load(runtime::RankContext& context, const std::string& path,
                                               const torch::Device& device, const std::string& rules_file = "");
  ~Pt2NativeRtProgram() override;
  Pt2NativeRtProgram(const Pt2NativeRtProgram&) = delete;
  Pt2NativeRtProgram& operator=(const Pt2NativeRtProgram&) = delete;

  std::optional<Arity> forward_arity(const std::string& path) const override;
  torch::Tensor run(const std::string& path, const std::vector<torch::Tensor>& inputs) const override;

 protected:
  torch::Tensor run_graph(const torch::Tensor& input_ids, const CachedStep* step,
                          const std::vector<ir::LocationId>* kept, Use use) override;

 private:
  Pt2NativeRtProgram(const std::string& path, PreparedPt2& prepared);

  std::unique_ptr<torch::nativert::ModelRunnerHandle> runner_;
};

}  // namespace frag::program
