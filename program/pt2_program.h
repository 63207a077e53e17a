//===- program/pt2_program.h - A .pt2 rank file made ready for torch.export -*- C++ -*-===//
//
// The preparation of a torch.export archive for a process that runs it with
// PyTorch (the Python front end): read the archive, check it across ranks
// (one export, rank order), rewrite a plain export in memory
// (passes/insert_fragment_ops_pt2) or take the rewritten file's embedded
// table, and index the table once (ir::LocationTable). The graph itself is run
// by torch.export in Python, its fragment ops bound there to the same ids
// (python/fragments/local/pt2_torch_export.py).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/location_table.h"
#include "runtime/pt2_archive.h"
#include "program/rank_program.h"
#include "runtime/rank_context.h"

#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace frag::program {

struct PreparedPt2 {
  std::shared_ptr<const ir::LocationTable> locations;
  /// The rewritten graph (models/model.json), ops in the file's form.
  nlohmann::json model;
  /// The dtype of the first floating-point parameter (the model computes in it).
  at::ScalarType dtype = at::kFloat;
  /// True where the file is a plain export rewritten here, in memory (`model` differs from the file's
  /// graph); false where frag rewrite wrote the file. Each executor writes the archive it needs from
  /// `model` (runtime::rewritten_archive): the archive's bytes are made once, by the one who reads them.
  bool rewritten_here = false;
  /// (path, class name) of every module the archive names and of their parents (containers such as a
  /// ModuleList run no node: their class is ""), the root as "" first; parents before children.
  std::vector<std::pair<std::string, std::string>> modules;
  /// The integer config the kit recorded per module path (head_size, input_size, …).
  std::map<std::string, std::map<std::string, int64_t>> attributes;
  /// Where the archive's forward takes a KV cache (exported with kv_cache=True).
  std::optional<runtime::KvCacheRecord> kv_cache;
};

/// Prepares this rank's .pt2 file; every rank fails alike if any rank fails.
PreparedPt2 prepare_pt2_rank(runtime::RankContext& context, const std::string& path,
                                     const std::string& rules_file = "");

/// What every executor of a .pt2 (Pt2NativeRtProgram here, Pt2TorchExportProgram in python/fragments/_C.cpp) answers
/// from its preparation alone: the dtype, the modules, their recorded integer config and the KV cache; and
/// the arguments a cached archive's forward(input_ids, positions, kv_cache, cache_len) takes.
class Pt2Program : public RankProgram {
 public:
  /// Takes `prepared`'s locations, modules and config (moved out of it).
  Pt2Program(const std::string& path, PreparedPt2& prepared);

  at::ScalarType dtype() const override { return dtype_; }
  std::vector<std::pair<std::string, std::string>> named_modules() const override { return modules_; }
  std::map<std::string, int64_t> int_attributes(const std::string& path) const override;

  bool has_kv_cache() const override { return kv_cache_.has_value(); }
  std::vector<int64_t> kv_cache_shape(int64_t max_batch, int64_t max_len) const override;
  int64_t max_positions() const override { return kv_cache_ ? kv_cache_->max_positions : 0; }
  /// A cached archive runs a plain forward as positions 0..T-1 into a scratch cache of T slots.
  torch::Tensor forward(const torch::Tensor& input_ids, const std::vector<ir::LocationId>* kept, Use use) final;
  torch::Tensor forward_cached(const torch::Tensor& input_ids, const CachedStep& step,
                               const std::vector<ir::LocationId>* kept) final;

 protected:
  /// Runs the archive's graph: forward(input_ids), or with `step` forward(input_ids, positions, kv_cache, 0)
  /// (the cache's slots are the span attended). `kept` and `use` as in RankProgram::forward.
  virtual torch::Tensor run_graph(const torch::Tensor& input_ids, const CachedStep* step,
                                  const std::vector<ir::LocationId>* kept, Use use) = 0;

 private:
  std::vector<std::pair<std::string, std::string>> modules_;
  std::map<std::string, std::map<std::string, int64_t>> attributes_;
  at::ScalarType dtype_;
  std::optional<runtime::KvCacheRecord> kv_cache_;
};

}  // namespace frag::program
