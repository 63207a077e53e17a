//===- python/fragments/_C_rules.cpp - The rule library and plans for hooks --===//
//
// Bindings for front ends that run a model they do not rewrite — vLLM's own
// workers (python/fragments/vllm) — so they use the same classification, fragment
// rules and plan parser as the TorchScript and .pt2 paths instead of a second
// copy in Python:
//   classify_layers   ir::ModuleDescription list (vLLM's attribute names) → the
//                     fragment table (passes::classify_parallel_layers) as JSON
//   whole_from_pieces / piece_of_whole   ir/fragment_rule.h on a rule's JSON
//   Rule              a rule parsed once (collective, piece_is_whole, the two above)
//   parse_plan        runtime::Plan::from_json, "segment"/"heads" resolved with
//                     the table's head layouts; steps come back as dicts
//   index_view        runtime::WholeIndex::select (a view: edits write through)
// Called from _C.cpp's module init (bind_rules).
//
//===----------------------------------------------------------------------===//
#include "ir/error.h"
#include "ir/fragment_rule.h"
#include "ir/fragment_table.h"
#include "ir/head_layout.h"
#include "ir/module_description.h"
#include "passes/classify_parallel_layers.h"
#include "runtime/plan.h"

#include <torch/csrc/utils/pybind.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

namespace frag::python {
namespace {

/// A config value as classify_parallel_layers reads it: int, bool or List[int].
c10::IValue config_value(const py::handle& value) {
  if (py::isinstance<py::bool_>(value)) return c10::IValue(value.cast<bool>());
  if (py::isinstance<py::int_>(value)) return c10::IValue(value.cast<int64_t>());
  if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value))
    return c10::IValue(value.cast<std::vector<int64_t>>());
  return c10::IValue(py::str(value).cast<std::string>());  // refused by the classification, named in its message
}

ir::FragmentRule rule_of(const std::string& rule_json) {
  return ir::rule_from_json(nlohmann::json::parse(rule_json));
}

/// classify_layers: the described modules (dicts in pre-order) -> the fragment table's JSON text.
std::string classify_layers(const py::list& modules, const std::string& source) {
  std::vector<ir::ModuleDescription> described;
  for (const auto& item : modules) {
    ir::ModuleDescription d;
    d.path = item["path"].cast<std::string>();
    d.class_name = item["class"].cast<std::string>();
    for (const auto& [name, value] : item["attributes"].cast<py::dict>())
      d.attributes[name.cast<std::string>()] = config_value(value);
    for (const auto& [name, shape] : item["parameters"].cast<py::dict>())
      d.parameter_shapes[name.cast<std::string>()] = shape.cast<std::vector<int64_t>>();
    d.config_origin = source;
    described.push_back(std::move(d));
  }
  return ir::to_json(passes::classify_parallel_layers(described, passes::LayerAliases{}, source)).dump();
}

using PathAttributes = std::map<std::string, std::map<std::string, int64_t>>;

/// One parsed step as the dict parse_plan returns.
py::dict step_dict(const runtime::PlanStep& step) {
  py::dict d;
  d["at"] = step.at;
  d["do"] = runtime::action_name(step.action);
  d["as"] = step.as;
  d["by"] = step.by;
  d["index"] = step.index ? py::object(py::str(step.index->text)) : py::object(py::none());
  d["visit"] = step.visit ? py::object(py::int_(*step.visit)) : py::object(py::none());
  d["value"] = step.value_tensor.defined() ? py::object(py::cast(step.value_tensor)) : py::object(py::none());
  d["value_name"] = step.value;
  d["modules"] = step.modules;
  return d;
}

/// parse_plan: a plan's JSON text -> its steps as dicts, "segment"/"heads" resolved through the table. The table
/// and the attributes are read only where a step names segments or heads: a worker parses every request's plan,
/// and the table of an 8-layer model alone took ~0.4 ms to parse (run39's profile).
py::list parse_plan(const std::string& text, const std::string& source, const std::string& base,
                    const std::string& table_json, const py::object& attributes_object) {
  auto plan = runtime::Plan::from_json(nlohmann::json::parse(text), source, base);
  std::optional<ir::FragmentTable> table;
  PathAttributes attributes;
  py::list steps;
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    auto& step = plan.steps[i];
    if (!step.segment.empty() || !step.heads.empty()) {
      if (!table) {
        table = ir::table_from_json(nlohmann::json::parse(table_json), source);
        attributes = attributes_object.cast<PathAttributes>();
      }
      const auto layout = ir::head_layout(*table, step.at, [&](const std::string& path) {
        auto it = attributes.find(path);
        return it == attributes.end() ? ir::IntAttributes{} : ir::IntAttributes(it->second.begin(),
                                                                                it->second.end());
      });
      runtime::resolve_heads(step, layout, fmt::format("{}: intervention {}: ", source, i));
    }
    steps.append(step_dict(step));
  }
  return steps;
}

/// A rule parsed once, for callers that apply it at every step (the vLLM worker): no JSON in the hot path.
void bind_rule_class(py::module& m) {
  py::class_<ir::FragmentRule>(m, "Rule")
      .def(py::init(&rule_of), py::arg("rule"), "The rule of its JSON text (frag::Error when it is not one).")
      .def_property_readonly(
          "collective", [](const ir::FragmentRule& r) { return ir::collective_name(ir::collective_for(r)); },
          "\"all_gather\", \"all_reduce\" or \"none\".")
      .def_property_readonly("piece_is_whole", &ir::piece_is_whole,
                             "One rank's piece is the whole as it is (a group of one, nothing to drop).")
      .def("whole_from_pieces", &ir::whole_from_pieces, py::arg("pieces"))
      .def("piece_of_whole", &ir::piece_of_whole, py::arg("whole"), py::arg("rank"))
      .def("__repr__", [](const ir::FragmentRule& r) { return "<fragments Rule: " + ir::describe(r) + ">"; });
}

}  // namespace

void bind_rules(py::module& m) {
  m.def(
      "classify_layers",
      &classify_layers,
      py::arg("modules"), py::arg("source"),
      "The fragment table (JSON) of described modules: dicts with path, class, attributes (config values "
      "by the kit's / vLLM's names) and parameters (name -> shape), in pre-order.");
  m.def(
      "whole_from_pieces",
      [](const std::string& rule, const std::vector<torch::Tensor>& pieces) {
        return ir::whole_from_pieces(rule_of(rule), pieces);
      },
      py::arg("rule"), py::arg("pieces"), "The whole from the ranks' pieces (group-rank order); rule as JSON.");
  m.def(
      "piece_of_whole",
      [](const std::string& rule, const torch::Tensor& whole, int64_t rank) {
        return ir::piece_of_whole(rule_of(rule), whole, rank);
      },
      py::arg("rule"), py::arg("whole"), py::arg("rank"), "Rank `rank`'s piece of `whole`; rule as JSON.");
  m.def(
      "collective_for",
      [](const std::string& rule) { return ir::collective_name(ir::collective_for(rule_of(rule))); },
      py::arg("rule"), "\"all_gather\", \"all_reduce\" or \"none\": the collective that makes the whole.");
  m.def(
      "describe_rule", [](const std::string& rule) { return ir::describe(rule_of(rule)); }, py::arg("rule"));
  bind_rule_class(m);
  m.def(
      "parse_plan",
      &parse_plan,
      py::arg("text"), py::arg("source"), py::arg("base"), py::arg("table"), py::arg("attributes"),
      "runtime::Plan::from_json on a plan's JSON text (values read relative to `base`); \"segment\"/\"heads\" "
      "become an index through the table's head layouts (`attributes`: path -> int attributes of QKV layers). "
      "Returns the steps as dicts.");
  m.def(
      "head_layout",
      [](const std::string& table_json, const std::string& location, const PathAttributes& attributes) {
        const auto table = ir::table_from_json(nlohmann::json::parse(table_json), "fragment table");
        py::dict out;
        const auto layout = ir::head_layout(table, location, [&](const std::string& path) {
          auto it = attributes.find(path);
          return it == attributes.end() ? ir::IntAttributes{} : ir::IntAttributes(it->second.begin(),
                                                                                  it->second.end());
        });
        for (const auto& region : layout)
          out[py::str(region.name)] = py::make_tuple(region.start, region.stop, region.head_dim);
        return out;
      },
      py::arg("table"), py::arg("location"), py::arg("attributes"),
      "name -> (start, stop, head_dim) of the heads on `location`'s last dim (ir::head_layout, as plans' "
      "\"segment\"/\"heads\" resolve them); table as JSON, attributes: path -> int attributes of QKV layers.");
  m.def(
      "index_view",
      [](const std::string& index, const torch::Tensor& whole, const std::string& location) {
        return runtime::WholeIndex::parse(index).select(whole, location);
      },
      py::arg("index"), py::arg("whole"), py::arg("location"),
      "The view of `whole` a numpy-style basic index selects (runtime::WholeIndex).");
}

}  // namespace frag::python
