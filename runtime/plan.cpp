//===- runtime/plan.cpp - Intervention plans (JSON) ----------------------===//
#include "runtime/plan.h"

#include "ir/digest.h"
#include "ir/error.h"
#include "ir/json_file.h"
#include "ir/location_table.h"
#include "runtime/safetensors.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <set>

namespace frag::runtime {
namespace {

using torch::indexing::Ellipsis;
using torch::indexing::Slice;
using torch::indexing::TensorIndex;

std::optional<int64_t> parse_bound(const std::string& text, const std::string& whole) {
  if (text.empty()) return std::nullopt;
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.find_first_of(" \t") != std::string::npos)
    fail("index '{}': '{}' is not an integer", whole, text);
  return value;
}

std::string trim(const std::string& s) {
  auto begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t") - begin + 1);
}

constexpr std::pair<const char*, Action> kActions[] = {{"save", Action::kSave},   {"set", Action::kSet},
                                                      {"add", Action::kAdd},     {"scale", Action::kScale},
                                                      {"zero", Action::kZero},   {"call", Action::kCall}};

std::optional<Action> parse_action(const std::string& text) {
  for (const auto& [name, action] : kActions)
    if (text == name) return action;
  return std::nullopt;
}

}  // namespace

WholeIndex WholeIndex::parse(const std::string& text) {
  WholeIndex index{text, {}};
  size_t start = 0;
  bool ellipsis = false;
  while (true) {
    size_t comma = text.find(',', start);
    std::string item = trim(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    IndexItem parsed;
    if (item == "...") {
      if (ellipsis) fail("index '{}': only one '...' is allowed", text);
      ellipsis = true;
      parsed.kind = IndexItem::Kind::kEllipsis;
    } else if (item.find(':') != std::string::npos) {
      parsed.kind = IndexItem::Kind::kSlice;
      size_t first = item.find(':');
      size_t second = item.find(':', first + 1);
      parsed.start = parse_bound(trim(item.substr(0, first)), text);
      parsed.stop = parse_bound(trim(item.substr(first + 1, second == std::string::npos ? std::string::npos
                                                                                      : second - first - 1)),
                                text);
      if (second != std::string::npos) {
        auto step = parse_bound(trim(item.substr(second + 1)), text);
        parsed.step = step.value_or(1);
        if (parsed.step <= 0) fail("index '{}': slice steps must be positive", text);
      }
    } else {
      auto value = parse_bound(item, text);
      if (!value) fail("index '{}': empty component", text);
      parsed.kind = IndexItem::Kind::kInteger;
      parsed.integer = *value;
    }
    index.items.push_back(parsed);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return index;
}

torch::Tensor WholeIndex::select(const torch::Tensor& whole, const std::string& location) const {
  size_t fixed = 0;
  for (const auto& item : items)
    if (item.kind != IndexItem::Kind::kEllipsis) ++fixed;
  if (fixed > static_cast<size_t>(whole.dim()))
    fail("{}: index '{}' has {} components but the whole tensor has {} dims (shape [{}])", location, text,
         fixed, whole.dim(), fmt::join(whole.sizes(), ", "));
  std::vector<TensorIndex> indices;
  int64_t dim = 0;
  for (const auto& item : items) {
    if (item.kind == IndexItem::Kind::kEllipsis) {
      indices.emplace_back(Ellipsis);
      dim += whole.dim() - static_cast<int64_t>(fixed);
      continue;
    }
    const int64_t size = whole.size(dim);
    if (item.kind == IndexItem::Kind::kInteger) {
      if (item.integer < -size || item.integer >= size)
        fail("{}: index '{}' selects {} on dim {} of size {} (whole shape [{}])", location, text, item.integer,
             dim, size, fmt::join(whole.sizes(), ", "));
      indices.emplace_back(item.integer);
    } else {
      for (auto bound : {item.start, item.stop})
        if (bound && (*bound < -size || *bound > size))
          fail("{}: index '{}' is out of range on dim {} of size {} (whole shape [{}])", location, text, dim,
               size, fmt::join(whole.sizes(), ", "));
      indices.emplace_back(Slice(item.start ? c10::optional<int64_t>(*item.start) : c10::nullopt,
                                 item.stop ? c10::optional<int64_t>(*item.stop) : c10::nullopt, item.step));
    }
    ++dim;
  }
  return whole.index(indices);
}

void WholeIndex::check_last_dim(int64_t width, const std::string& location) const {
  if (items.empty()) return;
  // Only a component that certainly addresses the last dim can be checked now.
  const bool aligned = items.front().kind == IndexItem::Kind::kEllipsis || items.size() == 1;
  if (!aligned) return;
  const IndexItem& last = items.back();
  if (last.kind == IndexItem::Kind::kInteger && (last.integer < -width || last.integer >= width))
    fail("{}: index '{}' selects {} on the last dim, whose whole width is {}", location, text, last.integer, width);
  if (last.kind == IndexItem::Kind::kSlice)
    for (auto bound : {last.start, last.stop})
      if (bound && (*bound < -width || *bound > width))
        fail("{}: index '{}' is out of range on the last dim, whose whole width is {}", location, text, width);
}

void resolve_heads(PlanStep& step, const ir::HeadLayout& layout, const std::string& where) {
  if (step.segment.empty() && step.heads.empty()) return;
  if (layout.empty())
    fail("{}{} has no attention heads: \"segment\" and \"heads\" apply at a QKVParallelLinear's output (q, k, "
         "v) and at the input of the o_proj beside it",
         where, step.at);
  // A qkv output has named segments; an o_proj input is one region, "heads", with no segment to name.
  const bool segmented = layout.size() > 1 || layout.front().name != "heads";
  const ir::HeadRegion* region = &layout.front();
  std::vector<std::string> names;
  for (const auto& r : layout) names.push_back(r.name);
  if (!segmented && !step.segment.empty())
    fail("{}{} has no segments: its heads span the whole width; use \"heads\" alone", where, step.at);
  if (segmented) {
    if (step.segment.empty())
      fail("{}{}: \"heads\" needs a \"segment\" ({}) to count heads in", where, step.at, fmt::join(names, ", "));
    region = nullptr;
    for (const auto& r : layout)
      if (r.name == step.segment) region = &r;
    if (!region) {
      // "K", "key", "values": the segment their first letter names.
      std::string suggestion;
      const char first = static_cast<char>(std::tolower(static_cast<unsigned char>(step.segment.front())));
      for (const auto& r : layout)
        if (r.name.front() == first) suggestion = fmt::format(" (did you mean \"{}\"?)", r.name);
      fail("{}{}: unknown segment \"{}\"; it has {}{}", where, step.at, step.segment, fmt::join(names, ", "),
           suggestion);
    }
  }
  int64_t start = region->start, stop = region->stop;
  if (!step.heads.empty()) {
    // Negative head numbers count from the end of the segment, as in Python: -1 is its last head.
    const int64_t count = region->heads();
    const std::string segment = segmented ? fmt::format(": segment {}", region->name) : std::string();
    std::vector<int64_t> heads;
    for (const int64_t head : step.heads) {
      if (head < -count || head >= count)
        fail("{}{}{} has {} heads (0 to {}, or {} to -1), got head {}", where, step.at, segment, count, count - 1,
             -count, head);
      heads.push_back(head < 0 ? head + count : head);
    }
    // Parse checked runs of one sign; a mixed run ([6, -1]) is only known to be consecutive now.
    for (size_t h = 1; h < heads.size(); ++h)
      if (heads[h] != heads[h - 1] + 1)
        fail("{}{}{}: \"heads\" [{}] are heads [{}] of {}, not consecutive heads in ascending order; write "
             "one step per run of heads",
             where, step.at, segment, fmt::join(step.heads, ", "), fmt::join(heads, ", "), count);
    start = region->start + heads.front() * region->head_dim;
    stop = region->start + (heads.back() + 1) * region->head_dim;
  }
  const std::string slice = fmt::format("{}:{}", start, stop);
  step.index = WholeIndex::parse(step.index ? step.index->text + "," + slice : "...," + slice);
  step.segment.clear();
  step.heads.clear();
}

const char* action_name(Action action) {
  for (const auto& [name, known] : kActions)
    if (known == action) return name;
  return "?";
}

bool edits(Action action) {
  return action == Action::kSet || action == Action::kAdd || action == Action::kScale || action == Action::kZero;
}

bool reserved_save_name(const std::string& name) { return name == "logits" || name == "__metadata__"; }

std::string PlanStep::describe() const {
  std::string text = fmt::format("{}|{}|{}|{}|{}|{}|{}", at, action_name(action), as, by, index ? index->text : "",
                                 visit ? std::to_string(*visit) : "*", fmt::join(modules, ","));
  if (value_tensor.defined()) {
    auto t = value_tensor.contiguous();
    uint64_t hash = ir::fnv1a_bytes(t.sizes().data(), t.sizes().size() * sizeof(int64_t));
    hash = ir::fnv1a_bytes(t.data_ptr(), t.numel() * t.element_size(), hash);
    text += fmt::format("|{}:{:016x}", c10::toString(t.scalar_type()), hash);
  }
  if (!steps.empty() || !rows.empty()) text += fmt::format("|steps={}:{}|rows={}", steps_from, steps_to, fmt::join(rows, ","));
  return text;
}

namespace {

/// "steps" as written ("prefill" | "decode" | "k" | "a:b" | "a:"; generation steps, 0 is the prefill): `shown` is
/// how the step wrote it (a JSON number or string), for the message.
void parse_steps(const std::string& text, const std::string& shown, PlanStep& step, const std::string& where) {
  const auto bad = [&] {
    fail("{}: \"steps\" must be \"prefill\", \"decode\", a step number such as \"3\" or a range \"a:b\" "
         "(step 0 is the prefill), got {}", where, shown);
  };
  step.steps = text;
  const auto number = [&](const std::string& part) -> int64_t {
    if (part.empty() || part.find_first_not_of("0123456789") != std::string::npos || part.size() > 18) bad();
    return std::stoll(part);
  };
  if (text == "prefill") {
    step.steps_from = 0, step.steps_to = 1;
  } else if (text == "decode") {
    step.steps_from = 1, step.steps_to = INT64_MAX;
  } else if (auto colon = text.find(':'); colon != std::string::npos) {
    step.steps_from = colon == 0 ? 0 : number(text.substr(0, colon));
    step.steps_to = colon + 1 == text.size() ? INT64_MAX : number(text.substr(colon + 1));
    if (step.steps_to <= step.steps_from) bad();
  } else {
    step.steps_from = number(text);
    step.steps_to = step.steps_from + 1;
  }
}

/// A list of integers as JSON writes it ("[2,3]"), for messages.
std::string json_list(const std::vector<int64_t>& values) { return fmt::format("[{}]", fmt::join(values, ",")); }

/// The keys of a plan step, quoted, for messages.
std::vector<std::string> field_names(const nlohmann::json& step) {
  std::vector<std::string> names;
  for (const auto& [key, _] : step.items()) names.push_back("\"" + key + "\"");
  return names;
}

/// Words a user may write for a field (and their typos, by edit distance): "action" is "do".
constexpr std::pair<const char*, const char*> kFieldSynonyms[] = {
    {"action", "do"},   {"op", "do"},         {"location", "at"}, {"loc", "at"},       {"where", "at"},
    {"name", "as"},     {"save_as", "as"},    {"visits", "visit"}, {"module", "modules"}, {"head", "heads"},
    {"tensor", "value"}, {"factor", "by"},    {"slice", "index"}};

/// What an empty string in each string field should have been, for messages (nullptr: not a string field).
const char* expected_in(const std::string& key) {
  if (key == "at") return "a location such as \"model.layers.0.mlp.output\" (frag inspect --all lists them)";
  if (key == "do") return "one of save, set, add, scale, zero, call";
  if (key == "as") return "the name to save under";
  if (key == "value") return "\"file.safetensors:tensor\"";
  if (key == "index") return "a numpy-style index of the whole tensor such as \"...,0:8\"";
  if (key == "segment") return "q, k or v";
  return nullptr;
}

/// " (did you mean \"do\"?)" for an unknown field `key`, or "".
std::string field_suggestion(const std::string& key) {
  std::vector<std::string> candidates = plan_step_fields();
  for (const auto& [synonym, _] : kFieldSynonyms) candidates.emplace_back(synonym);
  const auto close = ir::closest_names(key, candidates, 1);
  if (close.empty()) return "";
  std::string field = close.front();
  for (const auto& [synonym, meant] : kFieldSynonyms)
    if (field == synonym) field = meant;
  return fmt::format(" (did you mean \"{}\"?)", field);
}

/// Names the first field of `step` whose JSON type is not the one its key needs ("" if none). "heads",
/// "visit", "steps" and "rows" say what they need where they are read.
std::string wrong_type(const nlohmann::json& step) {
  for (const auto& [key, value] : step.items()) {
    const char* expected = nullptr;
    if (key == "at" || key == "do" || key == "as" || key == "value" || key == "index") {
      if (!value.is_string()) expected = "a string";
    } else if (key == "by") {
      if (!value.is_number()) expected = "a number";
    } else if (key == "segment") {
      if (!value.is_string()) expected = "a string (q, k or v)";
    } else if (key == "modules") {
      if (!value.is_array() || !std::all_of(value.begin(), value.end(), [](const auto& m) { return m.is_string(); }))
        expected = "a list of module paths (strings)";
    }
    if (expected) return fmt::format("\"{}\" must be {}, got {}", key, expected, value.dump());
  }
  return "";
}

/// The checks every field takes whatever the action (the schema's step properties): "at" and "do" given,
/// no unknown field, no empty string, each field's JSON type.
void check_fields(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) fail("{} is not an object", where);
  for (const char* key : {"at", "do"})
    if (!j.contains(key))
      fail("{}: needs \"{}\" ({}); it has {}", where, key,
           std::string(key) == "at" ? "the location, e.g. \"model.layers.0.mlp.output\""
                                    : "the action: save, set, add, scale, zero or call",
           j.empty() ? std::string("no fields") : fmt::format("the fields {}", fmt::join(field_names(j), ", ")));
  const auto& fields = plan_step_fields();
  for (const auto& [key, _] : j.items())
    if (std::find(fields.begin(), fields.end(), key) == fields.end())
      fail("{}: unknown field \"{}\"{}; a step's fields are {}", where, key, field_suggestion(key),
           fmt::join(fields, ", "));
  // An empty string names nothing: say which field, and what it should hold.
  for (const auto& [key, value] : j.items())
    if (value.is_string() && value.get_ref<const std::string&>().empty() && expected_in(key) != nullptr)
      fail("{}: \"{}\" is empty: expected {}", where, key, expected_in(key));
  if (const auto wrong = wrong_type(j); !wrong.empty()) fail("{}: {}", where, wrong);
}

Action read_action(const std::string& text, const std::string& where) {
  const auto action = parse_action(text);
  if (!action) {
    const auto close = ir::closest_names(text, action_names(), 1);
    fail("{}: unknown action \"{}\"{}; expected one of save, set, add, scale, zero, call", where, text,
         close.empty() ? "" : fmt::format(" (did you mean \"{}\"?)", close.front()));
  }
  return *action;
}

/// "file.safetensors:tensor": a file before the last ':' and a tensor name after it.
void check_value_ref(const std::string& value, const std::string& where) {
  const auto colon = value.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == value.size())
    fail("{}: \"value\" must be \"file.safetensors:tensor\", got \"{}\"{}", where, value,
         colon == std::string::npos ? ""
         : colon == 0               ? " (no file before ':')"
                                    : " (no tensor name after ':')");
}

/// "as", "value", "by" and "modules": what the action needs, checked wherever given.
void read_operands(const StepFields& f, PlanStep& step, const std::string& where) {
  const char* action = action_name(step.action);
  const bool names_output = step.action == Action::kSave || step.action == Action::kCall;
  if (names_output && !f.as) fail("{}: \"{}\" needs \"as\": the name to save under", where, action);
  if (f.as) {
    const auto& as = *f.as;
    // Names become safetensors keys and lines of output: no control characters (a NUL, a newline).
    if (std::any_of(as.begin(), as.end(), [](unsigned char c) { return c < 0x20 || c == 0x7f; }))
      fail("{}: \"as\": \"{}\" holds a control character; a saved name must be printable", where, as);
    if (reserved_save_name(as))
      fail("{}: \"as\": \"{}\" is reserved (frag run --out writes the logits and metadata under it)", where, as);
    if (names_output) step.as = as;
  }
  const bool takes_value = step.action == Action::kSet || step.action == Action::kAdd;
  if (takes_value && !f.value) fail("{}: \"{}\" needs \"value\": \"file.safetensors:tensor\"", where, action);
  if (f.value) {
    check_value_ref(*f.value, where);
    if (takes_value) step.value = *f.value;
  }
  if (step.action == Action::kScale) {
    if (!f.by) fail("{}: \"scale\" needs \"by\": the factor", where);
    step.by = *f.by;
  }
  if (step.action == Action::kCall && !f.modules)
    fail("{}: \"call\" needs \"modules\": the module paths to call, e.g. [\"model.norm\", \"lm_head\"]", where);
  if (f.modules) {
    const auto& modules = *f.modules;
    if (modules.empty())
      fail("{}: \"modules\" is empty: expected the module paths to call, e.g. [\"model.norm\", \"lm_head\"]", where);
    for (size_t m = 0; m < modules.size(); ++m)
      if (modules[m].empty())
        fail("{}: \"modules\": entry {} is empty: expected a module path such as \"model.norm\"", where, m);
    if (step.action == Action::kCall) step.modules = modules;
  }
}

/// "heads": each run of one sign consecutive and ascending.
void read_heads(const std::vector<int64_t>& heads, PlanStep& step, const std::string& where) {
  if (heads.empty()) fail("{}: \"heads\" must be a non-empty list of head numbers, e.g. [2], got []", where);
  step.heads = heads;
  // One slice of the last dim stands for them: only a run of consecutive heads is one slice. Negative
  // numbers count from the end (-1: the last head); a run of one sign is checked here, one mixing
  // signs when resolve_heads knows the segment's head count.
  for (size_t h = 1; h < step.heads.size(); ++h)
    if ((step.heads[h] < 0) == (step.heads[h - 1] < 0) && step.heads[h] != step.heads[h - 1] + 1)
      fail("{}: \"heads\" must be consecutive head numbers in ascending order (e.g. [2, 3], or [-2, -1] "
           "counted from the end), got {}; write one step per run of heads",
           where, json_list(heads));
}

/// "index", "segment" and "heads": the part of the whole a step acts on.
void read_selection(const StepFields& f, PlanStep& step, const std::string& where) {
  if (f.index) {
    if (step.action == Action::kSave || step.action == Action::kCall)
      fail("{}: \"index\" applies to edits only", where);
    try {
      step.index = WholeIndex::parse(*f.index);
    } catch (const Error& e) {
      fail("{}: \"index\": {}", where, e.what());
    }
  }
  if (!f.segment && !f.heads) return;
  if (step.action == Action::kCall) fail("{}: \"segment\" and \"heads\" apply to edits and saves only", where);
  if (f.segment) step.segment = *f.segment;
  if (f.heads) read_heads(*f.heads, step, where);
  // The segment's slice becomes the last component: an index beside it may only address leading dims.
  if (step.index && step.index->items.back().kind != IndexItem::Kind::kEllipsis)
    fail("{}: \"index\" '{}' may address the last dim, which \"segment\"/\"heads\" select; end it with "
         "'...' to index the leading dims only (e.g. \"0,...\")",
         where, step.index->text);
}

/// "visit", "steps" and "rows": when and on which batch rows a step acts.
void read_when(const StepFields& f, PlanStep& step, const std::string& where) {
  if (f.visit) {
    step.visit = *f.visit;
    if (*step.visit < 0) fail("{}: \"visit\" must be non-negative, got {}", where, *step.visit);
  }
  if (f.steps) parse_steps(*f.steps, f.steps_shown.empty() ? nlohmann::json(*f.steps).dump() : f.steps_shown, step, where);
  if (!f.rows) return;
  const auto& rows = *f.rows;
  if (rows.empty()) fail("{}: \"rows\" must be a non-empty list of batch rows such as [0, 2], got []", where);
  for (const int64_t r : rows) {
    if (r < 0) fail("{}: \"rows\" must list non-negative row numbers, got {}", where, json_list(rows));
    if (!step.rows.empty() && r <= step.rows.back())
      fail("{}: \"rows\" must be in ascending order without repeats, got {}", where, json_list(rows));
    step.rows.push_back(r);
  }
}

/// "heads", "visit", "steps" and "rows" of a JSON step: their JSON types, checked with what each needs.
void read_json_lists(const nlohmann::json& j, StepFields& f, const std::string& where) {
  if (j.contains("heads")) {
    const auto& heads = j.at("heads");
    if (!heads.is_array() || heads.empty() ||
        !std::all_of(heads.begin(), heads.end(), [](const auto& h) { return h.is_number_integer(); }))
      fail("{}: \"heads\" must be a non-empty list of head numbers, e.g. [2], got {}", where, heads.dump());
    for (const auto& h : heads)
      if (h.is_number_unsigned() && h.get<uint64_t>() > INT64_MAX)
        fail("{}: \"heads\": {} is not a head number", where, h.dump());
    f.heads = heads.get<std::vector<int64_t>>();
  }
  if (j.contains("visit")) {
    const auto& visit = j.at("visit");
    if (!visit.is_number_integer() || (visit.is_number_unsigned() && visit.get<uint64_t>() > INT64_MAX))
      fail("{}: \"visit\" must be a whole number of calls (0 for the first), got {}", where, visit.dump());
    f.visit = visit.get<int64_t>();
  }
  if (j.contains("steps")) {
    const auto& steps = j.at("steps");
    if (steps.is_string()) {
      f.steps = steps.get<std::string>();
    } else {  // a number, written as its digits: parse_steps refuses a negative one, or another type
      f.steps = steps.is_number_integer() && steps.get<int64_t>() >= 0 ? steps.dump() : std::string("-");
      f.steps_shown = steps.dump();
    }
  }
  if (j.contains("rows")) {
    const auto& rows = j.at("rows");
    if (!rows.is_array() || rows.empty())
      fail("{}: \"rows\" must be a non-empty list of batch rows such as [0, 2], got {}", where, rows.dump());
    for (const auto& r : rows)
      if (!r.is_number_integer() || r.get<int64_t>() < 0)
        fail("{}: \"rows\" must list non-negative row numbers, got {}", where, rows.dump());
    f.rows = rows.get<std::vector<int64_t>>();
  }
}

/// A JSON step's fields (check_fields passed: known names, no empty string, the string and number fields' types).
StepFields fields_of(const nlohmann::json& j, const std::string& where) {
  StepFields f;
  f.at = j.at("at").get<std::string>();
  f.action = j.at("do").get<std::string>();
  const auto text = [&](const char* key) {
    return j.contains(key) ? std::optional<std::string>(j.at(key).get<std::string>()) : std::nullopt;
  };
  f.as = text("as"), f.value = text("value"), f.index = text("index"), f.segment = text("segment");
  if (j.contains("by")) f.by = j.at("by").get<double>();
  if (j.contains("modules")) f.modules = j.at("modules").get<std::vector<std::string>>();
  read_json_lists(j, f, where);
  return f;
}

/// A plan's list of steps: the JSON itself (a bare list) or its "interventions", after its "format".
const nlohmann::json& interventions_of(const nlohmann::json& json, const std::string& source) {
  if (json.is_array()) return json;
  if (!json.is_object())
    fail("{}: a plan is {{\"format\": \"{}\", \"interventions\": [...]}} or a list of steps, got {}", source,
         kPlanFormat, json.type_name());
  std::vector<std::string> keys;
  for (const auto& [key, _] : json.items()) keys.push_back(key);
  if (!json.contains("interventions")) {
    const auto close = ir::closest_names("interventions", keys, 1);
    fail("{}: a plan needs \"interventions\": [...]{}", source,
         close.empty() ? "" : fmt::format(" (found \"{}\"; did you mean \"interventions\"?)", close.front()));
  }
  if (json.contains("format")) {
    const auto& format = json.at("format");
    if (!format.is_string())
      fail("{}: \"format\" must be a string such as \"{}\", got {}", source, kPlanFormat, format.dump());
    if (format.get<std::string>() != kPlanFormat)
      fail("{}: plan format is \"{}\", expected \"{}\" (this build reads that version only)", source,
           format.get<std::string>(), kPlanFormat);
  }
  for (const auto& key : keys)
    if (key != "format" && key != "interventions") {
      const auto close = ir::closest_names(key, {"format", "interventions"}, 1);
      fail("{}: unknown plan field \"{}\"{}; a plan has \"format\" and \"interventions\"", source, key,
           close.empty() ? "" : fmt::format(" (did you mean \"{}\"?)", close.front()));
    }
  const auto& list = json.at("interventions");
  if (!list.is_array()) fail("{}: \"interventions\" must be a list", source);
  return list;
}

}  // namespace

std::vector<std::string> action_names() {
  std::vector<std::string> names;
  for (const auto& [name, _] : kActions) names.emplace_back(name);
  return names;
}

const std::vector<std::string>& plan_step_fields() {
  static const std::vector<std::string> fields = {"at",    "do",    "as",      "value", "by",    "index",
                                                  "segment", "heads", "visit", "modules", "steps", "rows"};
  return fields;
}

PlanStep make_step(const StepFields& fields, const std::string& where) {
  PlanStep step;
  step.at = fields.at;
  step.action = read_action(fields.action, where);
  read_operands(fields, step, where);
  read_selection(fields, step, where);
  read_when(fields, step, where);
  return step;
}

PlanStep parse_step(const nlohmann::json& j, const std::string& where) {
  check_fields(j, where);
  try {
    return make_step(fields_of(j, where), where);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: {}", where, e.what());
  }
}

Plan Plan::from_file(const std::string& path) {
  return from_json(ir::read_json_file(path, "plan"), path, std::filesystem::path(path).parent_path().string());
}

Plan Plan::parse(const nlohmann::json& json, const std::string& source) {
  const auto& list = interventions_of(json, source);
  Plan plan;
  plan.source = source;
  std::set<std::string> saved_names;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string where = fmt::format("{}: intervention {}", source, i);
    PlanStep step = parse_step(list[i], where);
    if (!step.as.empty() && !saved_names.insert(step.as).second)
      fail("{}: \"as\": \"{}\" is already saved by an earlier step; give each step its own name", where, step.as);
    plan.steps.push_back(std::move(step));
  }
  return plan;
}

void Plan::load_values(const std::string& base) {
  for (size_t i = 0; i < steps.size(); ++i) {
    PlanStep& step = steps[i];
    if (step.value.empty()) continue;
    const auto colon = step.value.rfind(':');
    std::filesystem::path file = step.value.substr(0, colon);
    if (file.is_relative() && !base.empty()) file = std::filesystem::path(base) / file;
    auto tensors = read_safetensors(file.string());
    auto it = tensors.find(step.value.substr(colon + 1));
    if (it == tensors.end())
      fail("{}: intervention {}: {} has no tensor \"{}\"", source, i, file.string(), step.value.substr(colon + 1));
    step.value_tensor = it->second;
  }
}

Plan Plan::from_json(const nlohmann::json& json, const std::string& source, const std::string& base) {
  Plan plan = parse(json, source);
  plan.load_values(base);
  return plan;
}

}  // namespace frag::runtime
