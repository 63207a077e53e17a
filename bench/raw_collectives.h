//===- bench/raw_collectives.h - The raw collectives a save needs, in the forward -*- C++ -*-===//
//
// The benchmarks' baseline for saves: the rewritten graph with every
// gather -> intervene -> split triple replaced by frag_bench::raw_collective,
// the bare collective of its piece (all_gather or all_reduce over the rule's
// group, no assembly into a whole, no InterventionRuntime), and no other
// frag:: op: the original export's computation plus exactly the collectives
// the saves run, in the same places.
// Their results are kept to the end of the forward (raw_kept(): a hand-written
// save keeps its bytes too; dropped at once, the allocator would reuse the
// memory for free) and freed by the caller inside its timing, as saves are.
//
// Header-only for the two benchmark binaries; include it in ONE file per
// binary (it registers the frag_bench op library).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/fragment_rule.h"
#include "ir/op_schemas.h"
#include "passes/remove_fragment_ops.h"
#include "runtime/rank_context.h"

#include <nlohmann/json.hpp>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/library.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace frag::bench {

/// What this thread's raw collectives received in the current forward.
inline std::vector<at::Tensor>& raw_kept() {
  thread_local std::vector<at::Tensor> kept;
  return kept;
}

/// The bare collective of one piece, as a hand-written tensor-parallel model would place it.
inline at::Tensor raw_collective(const at::Tensor& piece, c10::string_view rule_text) {
  thread_local std::map<std::string, ir::FragmentRule> rules;
  const std::string rule_json(rule_text.data(), rule_text.size());
  auto it = rules.find(rule_json);
  if (it == rules.end()) it = rules.emplace(rule_json, ir::rule_from_json(nlohmann::json::parse(rule_json))).first;
  auto& group = runtime::current_rank_context().group(it->second.group);
  switch (ir::collective_for(it->second)) {
    case ir::CollectiveKind::kAllReduce:
      raw_kept().push_back(group.all_reduce(piece));
      return raw_kept().back();
    case ir::CollectiveKind::kAllGather: {
      auto pieces = group.all_gather(piece);
      raw_kept().insert(raw_kept().end(), pieces.begin(), pieces.end());
      return pieces[0];
    }
    case ir::CollectiveKind::kNone:
      break;
  }
  return piece;
}

// CONSERVATIVE: the op has side effects for the JIT, so the executor's dead
// code elimination keeps it although the graph does not use its result.
TORCH_LIBRARY(frag_bench, m) {
  m.def(torch::schema("raw_collective(Tensor piece, str rule) -> Tensor", c10::AliasAnalysisKind::CONSERVATIVE),
        &raw_collective);
}

/// Specializes a rewritten graph to the raw collectives alone: every triple
/// becomes frag_bench::raw_collective of its piece, placed where the gather
/// was, and the model carries on with its own piece; every other frag:: op
/// (whole locations) goes. What is left is the original export's computation
/// plus the bare collectives.
inline void replace_fragment_ops_with_raw_collectives(torch::jit::Graph& graph) {
  const auto gather = ir::kGatherKind;
  static const auto raw = c10::Symbol::fromQualString("frag_bench::raw_collective");
  std::vector<torch::jit::Node*> gathers;
  std::function<void(torch::jit::Block*)> collect = [&](torch::jit::Block* block) {
    for (torch::jit::Node* node : block->nodes()) {
      for (torch::jit::Block* inner : node->blocks()) collect(inner);
      if (node->kind() == gather) gathers.push_back(node);
    }
  };
  collect(graph.block());
  for (torch::jit::Node* node : gathers) {
    torch::jit::Node* collective = graph.create(raw, {node->input(0), node->input(2)});
    collective->insertBefore(node);
    collective->output()->setType(node->output()->type());
  }
  passes::remove_fragment_ops_except(graph, {});
}

}  // namespace frag::bench
