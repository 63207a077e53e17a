//===- program/rank_program.h - One rank's program, ready to run -*- C++ -*-===//
//
// What ShardedModel needs from a rank file once it is prepared, whatever its
// format: the location table, the module tree (config and call wrappers), and
// a forward whose fragment ops are bound to the table's ids. Three programs,
// for two formats and two executors of the second:
//
//   .pt  TorchScriptProgram      program/torchscript_program.h: run by LibTorch here
//   .pt2 Pt2NativeRtProgram      program/pt2_nativert_program.h: run by NativeRT in C++ (frag run)
//   .pt2 Pt2TorchExportProgram   python/fragments/_C.cpp: run by torch.export in Python
//                                (fragments.load; python/fragments/local/pt2_torch_export.py)
//
// Both .pt2 programs are a program::Pt2Program (program/pt2_program.h: the
// archive read, checked across ranks, rewritten and indexed here). The plan
// engine (ShardedModel: checks, saves, edits, cross-rank agreement, width
// probes, call wrappers) is one for all three.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/location_table.h"
#include "runtime/ad_hoc_call.h"

#include <torch/types.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace frag::program {

/// What a decode step passes besides the token ids (the kit's cached forward; program/decoder.h).
struct CachedStep {
  torch::Tensor positions;  ///< [B, T] int64: each new token's position, which is also its cache slot
  torch::Tensor kv_cache;   ///< this rank's cache, narrowed to the step's rows (dim 2)
  int64_t cache_len = 0;    ///< slots attended to: the longest row's length after this step
};

class RankProgram : public runtime::ModuleTree {
 public:
  /// How often a forward of one set of kept locations will run: a program may cache what it builds for
  /// repeated ones (a specialized graph); the width probe's runs once.
  enum class Use { kRepeated, kOnce };

  RankProgram(std::string path, std::shared_ptr<const ir::LocationTable> locations)
      : path_(std::move(path)), locations_(std::move(locations)) {}

  const std::string& path() const { return path_; }
  const std::shared_ptr<const ir::LocationTable>& locations() const { return locations_; }

  /// The dtype the model computes in (its first floating-point parameter's).
  virtual at::ScalarType dtype() const = 0;
  /// Where the model's weights are (a KV cache is allocated there).
  virtual torch::Device device() const { return torch::kCPU; }
  /// Where forwards may be captured in CUDA graphs (program/captured_forwards.h): the storage of the first
  /// weight, which a graph reads where it was (a change of it drops the graphs); nullptr where they may not
  /// (CPUs, builds without CUDA graphs, torch.export programs).
  virtual const void* capturable_weights() const { return nullptr; }
  /// (path, class name) of every module, the root as "".
  virtual std::vector<std::pair<std::string, std::string>> named_modules() const = 0;
  /// Runs forward(input_ids) without autograd, under the current rank context and intervention runtime,
  /// and returns the logits. The fragment ops act at least at `kept` (ascending ids) and may be dropped
  /// elsewhere; nullptr keeps them everywhere (idle where nothing waits).
  virtual torch::Tensor forward(const torch::Tensor& input_ids, const std::vector<ir::LocationId>* kept,
                                Use use) = 0;

  /// Whether forward takes a KV cache (a kit export made since cached generation): a TorchScript module
  /// with kv_cache_shape(max_batch, max_len), a .pt2 exported with kv_cache=True. Files made before do not.
  virtual bool has_kv_cache() const { return false; }
  /// This rank's cache shape [layers, 2, max_batch, kv heads, max_len, head size]; empty without a cache.
  virtual std::vector<int64_t> kv_cache_shape(int64_t /*max_batch*/, int64_t /*max_len*/) const { return {}; }
  /// The longest sequence the model's positions cover; 0 when unknown.
  virtual int64_t max_positions() const { return 0; }
  /// forward(input_ids, positions, kv_cache, cache_len), as forward runs it; only where has_kv_cache().
  virtual torch::Tensor forward_cached(const torch::Tensor& input_ids, const CachedStep& step,
                                       const std::vector<ir::LocationId>* kept) {
    (void)input_ids, (void)step, (void)kept;
    return {};
  }

 private:
  std::string path_;
  std::shared_ptr<const ir::LocationTable> locations_;
};

}  // namespace frag::program
