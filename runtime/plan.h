//===- runtime/plan.h - Intervention plans (JSON) ----------------*- C++ -*-===//
//
// A plan is the same JSON file on every rank: a list of interventions. Its
// format, "fragments.plan/1", is defined once in runtime/plan.schema.json (JSON
// Schema); this parser reads exactly what it allows (tests/runtime/plan_schema_test.py).
//   {"format": "fragments.plan/1", "interventions": [
//     {"at": "model.layers.0.mlp.down_proj.input", "do": "save", "as": "down_in"},
//     {"at": "model.layers.1.output", "do": "add", "value": "steer.safetensors:v",
//      "index": "...,0:64", "visit": 0},
//     {"at": "model.layers.0.self_attn.qkv_proj.output", "do": "zero", "index": "...,0:8"},
//     {"at": "model.layers.0.mlp.gate_up_proj.output", "do": "scale", "by": 0.5}]}
// "do": save | set | add | scale | zero | call. "index" is a numpy-style basic
// index of the whole tensor: comma-separated integers, slices a:b:c and one
// "..."; "visit" restricts a step to the k-th call of that module in a
// forward. A plan without "format", or a bare JSON list of steps, reads as
// fragments.plan/1; another format is refused in words.
//
// In generation (program/decoder.h: step 0 is the prefill, step k >= 1 the
// k-th decode step) "steps" names the steps a plan step acts at: "prefill",
// "decode" (every decode step), "k", or a range "a:b" (a to b-1; "a:" open);
// absent, every step. A plain forward is step 0. "rows" lists the rows it acts
// on: [0, 2]; absent, all. In generation they are the rows' stable ids
// (program/decoder.h: given as rows join, kept when others are dropped), in a
// plain forward batch indices (dim 0 of the whole).
//
// Where the value is laid out in attention heads (ir/head_layout.h), an edit
// or save may name a part of the last dim instead of an index:
//   {"at": "model.layers.0.self_attn.qkv_proj.output", "do": "zero", "segment": "k", "heads": [1]}
//   {"at": "model.layers.0.self_attn.o_proj.input", "do": "save", "as": "h23", "heads": [2, 3]}
// "segment" is q, k or v (qkv_proj's output); "heads" lists consecutive heads
// in ascending order, counted within the segment (or within o_proj's input);
// negative numbers count from its end as in Python (-1: the last head).
// At load (ShardedModel::apply) they become the equivalent index on the last
// dim; an "index" beside them must end in "..." (it indexes the leading dims).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/head_layout.h"

#include <torch/types.h>

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

namespace frag::runtime {

/// One component of a basic index: an integer, a slice or "...".
struct IndexItem {
  enum class Kind { kInteger, kSlice, kEllipsis } kind = Kind::kSlice;
  int64_t integer = 0;
  std::optional<int64_t> start, stop;
  int64_t step = 1;
};

/// A parsed numpy-style basic index ("...,0:64", "0,:,3", ":").
struct WholeIndex {
  std::string text;
  std::vector<IndexItem> items;

  /// Parses `text`; bad syntax is a frag::Error quoting it.
  static WholeIndex parse(const std::string& text);
  /// The view of `whole` this index selects. Out of range: frag::Error naming
  /// `location`, the index and the shape.
  torch::Tensor select(const torch::Tensor& whole, const std::string& location) const;
  /// Checks the index against a whole tensor whose last dim is `width` (other
  /// dims unknown until run time).
  void check_last_dim(int64_t width, const std::string& location) const;
};

/// The plan format this parser reads: a plan's "format" (absent: this one).
inline constexpr const char* kPlanFormat = "fragments.plan/1";

/// What a step does. Parsed once from the plan's "do"; run time switches on it.
enum class Action { kSave, kSet, kAdd, kScale, kZero, kCall };

/// The plan's word for an action ("save", …).
const char* action_name(Action action);
/// Every action's word, in Action's order (the schema's "do" enum).
std::vector<std::string> action_names();
/// A step's fields, in the README's order (the schema's step properties).
const std::vector<std::string>& plan_step_fields();
/// Whether the action changes the whole tensor.
bool edits(Action action);

/// One intervention of a plan.
struct PlanStep {
  std::string at;
  Action action = Action::kSave;
  std::string as;      ///< name of the saved tensor (save, call)
  std::string value;   ///< "file.safetensors:tensor" (set, add), for messages
  double by = 1.0;     ///< factor (scale)
  std::optional<WholeIndex> index;
  /// "segment" and "heads" as written (empty: not given); resolve_heads turns them into `index`.
  std::string segment;
  std::vector<int64_t> heads;  ///< consecutive, ascending; negative: from the end (resolve_heads normalises)
  std::optional<int64_t> visit;
  std::vector<std::string> modules;  ///< modules to run ad hoc (call)
  std::string steps;                 ///< "steps" as written; empty: every step
  int64_t steps_from = 0;            ///< the generation steps it acts at: [steps_from, steps_to)
  int64_t steps_to = INT64_MAX;
  std::vector<int64_t> rows;         ///< rows it acts on (ascending; ids in generation); empty: all
  /// Whether it acts at generation step `step` (0: the prefill or a plain forward).
  bool acts_at(int64_t step) const { return step >= steps_from && step < steps_to; }
  torch::Tensor value_tensor;        ///< loaded from `value`
  /// A canonical text of the step, its value's bytes included (not its path):
  /// what ranks compare to agree that they run the same plan.
  std::string describe() const;
};

/// A step's fields as written, before their meaning is checked: a JSON step's (parse_step reads them, after
/// the checks only JSON needs: field names, empty strings, JSON types), or a front end's typed step
/// (python/fragments/core/step.py: Step, read by fragments._C without JSON). Absent fields are nullopt.
struct StepFields {
  std::string at, action;
  std::optional<std::string> as, value, index, segment;
  std::optional<double> by;
  std::optional<std::vector<int64_t>> heads, rows;
  std::optional<int64_t> visit;
  std::optional<std::vector<std::string>> modules;
  std::optional<std::string> steps;  ///< "prefill", "decode", "k", "a:b"
  std::string steps_shown;           ///< how "steps" was written where not as a string (a number), for messages
};

/// One step from its fields: every check of a step's meaning (the action's word, what it needs, "as", the
/// index, "segment"/"heads", "visit", "steps", "rows"); `where` starts every error. No I/O: a "value" is named
/// (checked as "file:tensor"), not loaded.
PlanStep make_step(const StepFields& fields, const std::string& where);

/// Parses one step (a JSON object) into its typed form: the JSON checks, then make_step.
PlanStep parse_step(const nlohmann::json& json, const std::string& where);

/// Replaces a step's "segment"/"heads" by the equivalent index on the last dim,
/// given its location's head layout (ir::head_layout). Errors start with `where`
/// and name the location: an unknown segment, a head out of range, a location
/// without heads. Negative heads count from the segment's end (-1: its last);
/// after that the heads must be consecutive and ascending. A step without them
/// is left as it is.
void resolve_heads(PlanStep& step, const ir::HeadLayout& layout, const std::string& where);

/// A whole plan.
struct Plan {
  std::string source;
  std::vector<PlanStep> steps;

  /// Reads a plan file and the tensors it names (paths relative to the plan's folder).
  static Plan from_file(const std::string& path);
  /// Parses a plan and loads its values; `source` names it in errors; `base` is the folder value paths are
  /// relative to.
  static Plan from_json(const nlohmann::json& json, const std::string& source, const std::string& base);
  /// Parses a plan without reading its values (step.value named, value_tensor undefined): its format
  /// checked, every step typed, each save name used once.
  static Plan parse(const nlohmann::json& json, const std::string& source);
  /// Loads every step's "value" (relative paths under `base`).
  void load_values(const std::string& base);
};

/// Names a save may not take: they would overwrite the logits or the file's metadata in `frag run --out`.
bool reserved_save_name(const std::string& name);

}  // namespace frag::runtime
