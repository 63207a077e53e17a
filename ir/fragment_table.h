//===- ir/fragment_table.h - Which locations are fragmented, and how -*- C++ -*-===//
//
// The fragment table is what the pass learns about one rank file and what the
// runtime trusts: every parallel layer instance with the fragment rule of its
// input and output (absent when that side is whole), plus the locations the
// rewrite found whole or rank-local. It is saved as JSON inside a rewritten
// file (extra file "fragments/rules.json") and printed by `frag inspect --json`.
// It never depends on the rank: all ranks' tables of one export are equal.
//
// A location is "<module path>.input" or "<module path>.output". `.input` is
// the module's first positional argument, `.output` its main output tensor
// (for a linear layer the first element of (output, output_bias)).
//
// JSON (format "fragments.table/1"):
//   {"format": "fragments.table/1", "tp_size": 2,
//    "layers": [{"path": "model.layers.0.self_attn.qkv_proj",
//                "class": "QKVParallelLinear", "kind": "QKVParallelLinear",
//                "input": null | {"rule": RULE, "whole_width": 64 | null},
//                "output": null | {"rule": RULE, "whole_width": 128 | null},
//                "notes": ["gather_output=True: the layer gathers itself"]}],
//    "whole": ["model.layers.0.output", …],
//    "rank_local": [{"location": "model.layers.0.mlp.act_fn.output",
//                    "derived_from": "model.layers.0.mlp.gate_up_proj.output",
//                    "whole_at": "model.layers.0.mlp.down_proj.input"  (only where known)}, …]}
// RULE is ir::to_json(FragmentRule).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/fragment_rule.h"

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

namespace frag::ir {

/// One side (input or output) of a parallel layer that is fragmented.
struct FragmentedSide {
  FragmentRule rule;
  /// Width of the whole tensor's fragmented dim where the weights tell it.
  std::optional<int64_t> whole_width;
};

/// One parallel layer instance.
struct LayerEntry {
  std::string path;        ///< module path, e.g. "model.layers.0.mlp.down_proj"
  std::string class_name;  ///< class name in the file, mangling stripped
  std::string kind;        ///< the known layer kind it is treated as
  std::optional<FragmentedSide> input;
  std::optional<FragmentedSide> output;
  /// Why a side is not fragmented, for people ("reduce_results=True: …").
  std::vector<std::string> notes;
};

/// A location whose value derives from a fragment but sits at no fragmented boundary.
struct RankLocalLocation {
  std::string location;
  std::string derived_from;  ///< the fragmented location it derives from
  /// The fragmented location where this very value is gathered whole, "" if none: act_fn's output is
  /// down_proj's input, so the whole activation is read at "model.layers.0.mlp.down_proj.input".
  std::string whole_at;
};

/// Everything the pass knows about one rank file.
struct FragmentTable {
  int64_t tp_size = 1;
  std::vector<LayerEntry> layers;
  /// Module-boundary locations holding whole values (filled by the rewrite).
  std::vector<std::string> whole;
  /// Module-boundary locations holding rank-local values (filled by the rewrite).
  std::vector<RankLocalLocation> rank_local;

  /// The fragmented side at a location, or nullptr where it is not fragmented.
  const FragmentedSide* side_at(const std::string& location) const;
  /// The rule at a location, or nullptr where it is not fragmented.
  const FragmentRule* rule_at(const std::string& location) const;
  /// The layer entry of a module path, or nullptr.
  const LayerEntry* layer(const std::string& path) const;
  /// Every fragmented location, in layer order (a layer's input before its output).
  std::vector<std::string> fragmented_locations() const;
};

inline constexpr const char* kTableFormat = "fragments.table/1";

nlohmann::json to_json(const FragmentTable& table);
/// Parses a table; `source` names it in errors.
FragmentTable table_from_json(const nlohmann::json& json, const std::string& source);

bool operator==(const FragmentedSide& a, const FragmentedSide& b);
bool operator==(const LayerEntry& a, const LayerEntry& b);

/// Lists each location once, after a rewrite that saw modules called several times: a location whole on
/// one call and rank-local on another is rank-local (no hook may rely on seeing a whole value there); a
/// rank-local location keeps the first whole_at found. Both rewrites (TorchScript and .pt2) end with it.
void settle_location_lists(FragmentTable& table);

/// "<path>.input" / "<path>.output".
std::string input_location(const std::string& path);
std::string output_location(const std::string& path);

}  // namespace frag::ir
