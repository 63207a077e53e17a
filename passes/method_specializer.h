//===- passes/method_specializer.h - Method bodies per folded config -*- C++ -*-===//
//
// The bodies the rewrite walks in place of a call: a submodule method's graph
// with the instance's config folded in (bool, int, float, str and None
// attributes it reads from self that decide a branch or a loop become
// constants, then constants propagate and the branches not taken go), and a
// free function's graph. Instances of one class with equal deciding config
// (the 80 decoder layers of one file) share one body, made once; config that
// only enters computation (a layer's KV cache slot) stays a read, so it does
// not split them. The analysis of the rewrite (analyze_location_flow) and its
// insertion (insert_fragment_ops) walk the same bodies.
//
// Bodies carry no debug names: copied once per call site into one graph,
// named values collide, and LibTorch's printer (Module::save) probes candidate
// after candidate for a free name, which made saving superlinear in depth.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/api/module.h>

#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace frag::passes {

/// The attribute a file rewritten per class gives each instance of a class whose methods compute
/// locations from self (insert_fragment_ops_per_class): its module path. Never folded into a body (one
/// body serves every instance); the inlining at load folds it per call site.
inline constexpr const char* kModulePathAttribute = "_frag_path";

/// Every method graph of every module class in root's tree, each once.
std::vector<torch::jit::GraphFunction*> method_graphs(const torch::jit::Module& root);

class MethodSpecializer {
 public:
  /// `callee` (a method of `instance`'s class) with `instance`'s deciding config folded in.
  std::shared_ptr<torch::jit::Graph> method_body(torch::jit::GraphFunction& callee,
                                                 const c10::ivalue::Object& instance);

  /// A free function's graph (fragkit.distributed's all-reduce, a rotary helper).
  std::shared_ptr<torch::jit::Graph> function_body(torch::jit::GraphFunction& function);

  /// The submodule calls (prim::CallMethod) of `method`'s own graph, in graph order. A call in a body
  /// made by method_body names its place in this list (call_site): the per-class rewrite instruments
  /// the method's own graph at the sites the analysis met in its bodies.
  const std::vector<torch::jit::Node*>& call_sites(torch::jit::GraphFunction& method);

  /// The index in call_sites(method) of `call`, a call of a body made by method_body(method, …) or of
  /// `method`'s own graph; nullopt for a call of another graph (a free function's body).
  std::optional<size_t> call_site(torch::jit::GraphFunction& method, const torch::jit::Node* call);

 private:
  /// What a method reads from self that decides its shape (found once per method), and its bodies by
  /// folded values.
  struct Specializations {
    struct Read {
      std::string name;
      std::optional<size_t> slot;  ///< the attribute's slot; none for a class constant
      c10::IValue constant;
    };
    bool scanned = false;
    std::vector<Read> reads;
    std::vector<std::pair<std::vector<std::optional<c10::IValue>>, std::shared_ptr<torch::jit::Graph>>> bodies;
  };
  std::unordered_map<const torch::jit::GraphFunction*, Specializations> methods_;
  std::unordered_map<const torch::jit::GraphFunction*, std::shared_ptr<torch::jit::Graph>> functions_;
  struct Sites {
    std::vector<torch::jit::Node*> calls;
    std::unordered_map<const torch::jit::Node*, size_t> index;  ///< own graph's and bodies' calls -> index
  };
  std::unordered_map<const torch::jit::GraphFunction*, Sites> sites_;
  Sites& sites_of(torch::jit::GraphFunction& method);
};

}  // namespace frag::passes
