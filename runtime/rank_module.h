//===- runtime/rank_module.h - One rank's exported module --------*- C++ -*-===//
//
// Loads one rank's TorchScript file, reads what the export says about it
// (fragkit.json: export id, tp_size, tp_rank; or the root's tp_size/tp_rank
// attributes) and checks, across all ranks and before any collective, that
// the files belong to one export and were given in rank order.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "runtime/rank_context.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/types.h>

#include <map>
#include <string>

namespace frag::runtime {

/// What an export says about one rank file.
struct ExportInfo {
  std::string export_id;  ///< same for every rank file of one export ("" if unknown)
  int64_t tp_size = 1;
  int64_t tp_rank = 0;
  std::string model;  ///< e.g. "llama"; informational
};

/// A loaded rank file.
struct RankModule {
  std::string path;
  torch::jit::Module module;
  ExportInfo info;
  /// Extra files stored beside the code (fragkit.json, the rule table, …).
  std::map<std::string, std::string> extra_files;
};

/// Names of extra files fragments reads when present.
inline constexpr const char* kExportInfoFile = "fragkit.json";
inline constexpr const char* kRuleTableFile = "fragments/rules.json";

/// Loads `path` onto `device`. Not TorchScript, truncated or missing: frag::Error naming the file.
RankModule load_rank_module(const std::string& path, const torch::Device& device = torch::kCPU);

/// Loads this rank's file and checks with every other rank that all files come
/// from one export, that tp_size equals the world size, and that each rank got
/// the file of its own tp_rank. Every rank throws the same frag::Error if any
/// check fails anywhere, so no rank enters a collective alone.
RankModule load_and_check_rank_module(RankContext& context, const std::string& path,
                                      const torch::Device& device = torch::kCPU);

/// The checks of load_and_check_rank_module on what a rank file of either format says (`info`, read from
/// `path`; `error`: why this rank could not read it). Every rank throws the same frag::Error if any fails.
void check_export_across_ranks(RankContext& context, const std::string& path, const ExportInfo& info,
                               std::string error);

/// The user-facing message inside an error raised through the TorchScript interpreter (which wraps it in
/// a traceback): the raised exception's message, one line.
std::string interpreter_message(const std::string& text);

/// True when `path` is a torch.export archive (a zip whose archive_format record says "pt2"). Its
/// loading is runtime/pt2_archive.h's; load_rank_module refuses one in words, not as a damaged file.
bool is_torch_export_archive(const std::string& path);

/// Whether TorchScript's GPU fusers (TensorExpr/NNC) may act in this runtime's forwards (run_forward,
/// ad-hoc calls) of a module that computes in bf16 or fp16. Off by default: a fusion group keeps such a
/// chain's intermediates in float and rounds only at its outputs, so where a group ends decides the logits,
/// and any node a plan adds (a save's read, a fragment op) moves that end (max |diff| 0.05 in 8B-shaped bf16
/// logits). Op by op, as the eager PyTorch model computes, the original and every rewritten graph round alike:
/// bit-identical logits. Costs the fused elementwise kernels (about 1.25x on an 8B-shaped 128-token forward,
/// bench/results/issue17_one_gpu.md). fp32 forwards keep LibTorch's setting (fusion there rounds as
/// op by op does in our tests); CPUs: LibTorch fuses nothing there.
void set_gpu_fusion(bool allowed);
bool gpu_fusion();

/// True when `module`'s first floating-point parameter is bf16 or fp16.
bool computes_in_half_precision(const torch::jit::Module& module);

/// While one made with `half_precision` exists and gpu_fusion() is off, TorchScript fuses nothing on GPUs;
/// LibTorch's own setting comes back when the last such scope ends. That switch is process-wide: other
/// TorchScript code running meanwhile on another thread sees it too. The executor decides fusion when it
/// builds a graph's plan (the forwards after the first), inside the forward, so the scope covers it.
class GpuFusionScope {
 public:
  explicit GpuFusionScope(bool half_precision);
  ~GpuFusionScope();
  GpuFusionScope(const GpuFusionScope&) = delete;
  GpuFusionScope& operator=(const GpuFusionScope&) = delete;

 private:
  bool active_;
};

/// Runs forward(input_ids) without autograd (inside a GpuFusionScope) and returns the logits: the
/// module's own forward, or `forward` (a graph of forward's signature, self
/// first, such as a copy specialized by passes::remove_fragment_ops_except).
torch::Tensor run_forward(RankModule& rank_module, const torch::Tensor& input_ids,
                          torch::jit::Function* forward = nullptr);

}  // namespace frag::runtime
