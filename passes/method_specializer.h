//===- passes/method_specializer.h - Method bodies per folded config -*- C++ -*-===//
//
// The bodies the rewrite walks in place of a call: a submodule method's graph
// with the instance's config folded in (bool, int, float, str and None
// attributes it reads from self become constants, then constants propagate),
// and a free function's graph. Instances of one class with equal config (the
// 80 decoder layers of one file) share one body, made once; the analysis of
// the rewrite (analyze_location_flow) and its insertion (insert_fragment_ops)
// walk the same bodies.
//
// Bodies carry no debug names: copied once per call site into one graph,
// named values collide, and LibTorch's printer (Module::save) probes candidate
// after candidate for a free name, which made saving superlinear in depth.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/script.h>

#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace frag::passes {

class MethodSpecializer {
 public:
  /// `callee` (a method of `instance`'s class) with `instance`'s config folded in.
  std::shared_ptr<torch::jit::Graph> method_body(torch::jit::GraphFunction& callee,
                                                 const torch::jit::Module& instance);

  /// A free function's graph (fragkit.distributed's all-reduce, a rotary helper).
  std::shared_ptr<torch::jit::Graph> function_body(torch::jit::GraphFunction& function);

 private:
  /// What a method reads from self (found once per method), and its bodies by folded values.
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
};

}  // namespace frag::passes
