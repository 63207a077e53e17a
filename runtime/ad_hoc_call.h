//===- runtime/ad_hoc_call.h - Run a parallel layer on whole tensors -*- C++ -*-===//
//
// A logit lens applies model.norm and lm_head to an intermediate hidden
// state; an attribution study runs down_proj on an edited activation. The
// caller holds whole tensors, but a parallel layer's forward takes and returns
// this rank's piece. A call wrapper bridges that with the rules of the
// fragment table (the same rules the triples use): the whole input is cut to
// this rank's share by the layer's input rule, the layer's own forward runs
// (its parameters stay this rank's slice), and its output is reassembled by
// its output rule. Sides that are not fragmented pass through; modules that
// are not parallel layers (norms, whole blocks) run as they are.
//
// Every rank must make the same calls in the same order: a wrapper runs
// collectives, so a call under rank-dependent control flow deadlocks.
// The wrapper runs the module's own method, not the rewritten root graph, so a
// call made while visiting a location neither re-enters its triple nor
// gathers twice.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/location_table.h"
#include "runtime/rank_context.h"

#include <torch/csrc/jit/api/module.h>
#include <torch/types.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace frag::runtime {

/// The modules of one rank's model as a call wrapper needs them, whatever format they came from:
/// ScriptModuleTree for a TorchScript module; a .pt2 program's tree lives in Python (torch.export's
/// unflattened module, python/fragments/_C.cpp).
class ModuleTree {
 public:
  /// The arguments of a module's forward: all of them and those without a default.
  struct Arity {
    size_t arguments = 0;
    size_t required = 0;
  };
  virtual ~ModuleTree() = default;
  /// frag::Error if `path` names no module; nullopt if the module has no forward.
  virtual std::optional<Arity> forward_arity(const std::string& path) const = 0;
  /// The module's integer attributes (a layer's config: input_size, head_size, …); empty if none.
  virtual std::map<std::string, int64_t> int_attributes(const std::string& path) const = 0;
  /// Runs the module's own forward (no fragment ops) on `inputs` without autograd; returns its main
  /// output (the first of a tuple).
  virtual torch::Tensor run(const std::string& path, const std::vector<torch::Tensor>& inputs) const = 0;
};

/// The modules of a TorchScript module. Their methods are the export's own: the fragment pass rewrites
/// only the root's forward.
class ScriptModuleTree : public ModuleTree {
 public:
  explicit ScriptModuleTree(torch::jit::Module root) : root_(std::move(root)) {}
  std::optional<Arity> forward_arity(const std::string& path) const override;
  std::map<std::string, int64_t> int_attributes(const std::string& path) const override;
  torch::Tensor run(const std::string& path, const std::vector<torch::Tensor>& inputs) const override;

 private:
  torch::jit::Module root_;
};

/// Call wrappers for the modules of one rank's model.
class AdHocCaller {
 public:
  AdHocCaller(const ModuleTree& modules, const ir::LocationTable& locations)
      : modules_(&modules), locations_(&locations) {}

  /// Throws frag::Error if `path` names no module, or a module without a call
  /// wrapper (its forward needs more than one tensor, or its input or output
  /// is rank-local, so no whole value exists for it).
  void check_callable(const std::string& path, size_t tensors = 1) const;

  /// The whole input width `path` expects, where its config tells (0 if unknown).
  int64_t expected_input_width(const std::string& path) const;

  /// Runs `paths` in order on the whole tensor `whole`; returns the whole result.
  torch::Tensor call(RankContext& context, const std::vector<std::string>& paths, const torch::Tensor& whole) const;

  /// Runs one module on whole tensors: the first is cut by the module's input
  /// rule, the others (a FusedMoE's router_logits) are whole on every rank and
  /// pass as they are. Returns the whole main output.
  torch::Tensor call_module(RankContext& context, const std::string& path,
                            const std::vector<torch::Tensor>& wholes) const;

 private:
  const ModuleTree* modules_;
  const ir::LocationTable* locations_;
};

}  // namespace frag::runtime
