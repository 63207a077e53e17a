//===- program/rank_program.h - One rank's program, ready to run -*- C++ -*-===//
//
// What ShardedModel needs from a rank file once it is prepared, whatever its
// format: the location table, the module tree (config and call wrappers), and
// a forward whose fragment ops are bound to the table's ids.
//
//   .pt  (TorchScript)   program/torchscript_program.h: run by LibTorch here
//   .pt2 (torch.export)  python/fragments/_C.cpp: run by torch.export in Python,
//                        prepared by program/exported_rank.h
//
// The plan engine (ShardedModel: checks, saves, edits, cross-rank agreement,
// width probes, call wrappers) is one for both.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/location_table.h"
#include "runtime/ad_hoc_call.h"

#include <torch/torch.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace frag::program {

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

 private:
  std::string path_;
  std::shared_ptr<const ir::LocationTable> locations_;
};

}  // namespace frag::program
