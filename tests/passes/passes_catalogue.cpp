//===- tests/passes/passes_catalogue.cpp - The IR docs/passes.md shows -*- C++ -*-===//
//
//   passes_catalogue RANK0.pt RANK0.pt2
//
// Runs every pass of passes/ on rank 0 of the tiny kit model that
// tests/passes/catalogue_model.py exports (tp 2, both formats) and prints
// what each one sees and makes, section by section ("=== name ===").
// docs/passes.md quotes these sections; tests/passes/passes_catalogue_test.py
// reruns this program and checks that every quoted line is still printed.
// A .pt2 graph (models/model.json) is printed one node a line, as
// `name = target(args)`.
//
//===----------------------------------------------------------------------===//
#include "ir/error.h"
#include "ir/fragment_rule.h"
#include "ir/fragment_table.h"
#include "ir/location_table.h"
#include "ir/op_schemas.h"
#include "passes/analyze_location_flow.h"
#include "passes/bind_group_ids.h"
#include "passes/bind_location_ids.h"
#include "passes/classify_parallel_layers.h"
#include "passes/insert_fragment_ops.h"
#include "passes/insert_fragment_ops_pt2.h"
#include "passes/method_specializer.h"
#include "passes/remove_fragment_ops.h"
#include "passes/rewrite_for_fragments.h"
#include "runtime/pt2_archive.h"
#include "runtime/rank_module.h"

#include <nlohmann/json.hpp>
#include <torch/script.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <iostream>
#include <string>

namespace {

using namespace frag;
using nlohmann::json;

void section(const std::string& name) { std::cout << "\n=== " << name << " ===\n"; }

std::shared_ptr<torch::jit::Graph> graph_of(const torch::jit::Module& m, const std::string& method = "forward") {
  return torch::jit::toGraphFunction(m.get_method(method).function()).graph();
}

/// Without source ranges: they name the exporting machine's paths.
void print_graph(const torch::jit::Graph& graph) { std::cout << graph.toString(/*print_source_locations=*/false); }

/// A pass's refusal, as its user reads it.
void print_refusal(const std::function<void()>& run) {
  try {
    run();
    std::cout << "(not refused)\n";
  } catch (const frag::Error& e) {
    std::cout << "frag::Error: " << e.what() << "\n";
  }
}

/// A side's rule (its JSON form, as the graph's constants carry it) and whole width, or "whole".
std::string side_text(const std::optional<ir::FragmentedSide>& side) {
  if (!side) return "whole";
  return ir::to_json(side->rule).dump() + (side->whole_width ? " width " + std::to_string(*side->whole_width) : "");
}

/// The table one layer a line, then the whole and rank-local locations.
void print_table(const ir::FragmentTable& table) {
  std::cout << "tp_size " << table.tp_size << "\n";
  for (const auto& layer : table.layers)
    std::cout << layer.path << " (" << layer.kind << ")\n  input  " << side_text(layer.input) << "\n  output "
              << side_text(layer.output) << "\n";
  for (const auto& location : table.whole) std::cout << "whole " << location << "\n";
  for (const auto& local : table.rank_local)
    std::cout << "rank-local " << local.location << " <- " << local.derived_from << " (whole at " << local.whole_at
              << ")\n";
}

/// One node a line: `name = target(args)`; tensors by name, strings quoted, other arguments as JSON.
void print_exported(const json& model) {
  const auto& graph = model.at("graph_module").at("graph");
  for (const auto& node : graph.at("nodes")) {
    std::string args;
    for (const auto& input : node.at("inputs")) {
      const auto& arg = input.at("arg");
      if (!args.empty()) args += ", ";
      if (arg.contains("as_tensor")) args += arg["as_tensor"]["name"].get<std::string>();
      else if (arg.contains("as_string")) args += json(arg["as_string"]).dump();
      else args += arg.begin().value().dump();
    }
    std::string out = "_";
    const auto& outputs = node.at("outputs");
    if (!outputs.empty() && outputs[0].contains("as_tensor")) out = outputs[0]["as_tensor"]["name"];
    std::cout << out << " = " << node.at("target").get<std::string>() << "(" << args << ")\n";
  }
  std::string results;
  for (const auto& output : graph.at("outputs"))
    results += (results.empty() ? "" : ", ") + output.at("as_tensor").at("name").get<std::string>();
  std::cout << "return " << results << "\n";
}

const char* kind_name(passes::VisitKind kind) {
  switch (kind) {
    case passes::VisitKind::kFragmented: return "fragmented";
    case passes::VisitKind::kRankLocal: return "rank-local";
    case passes::VisitKind::kWhole: return "whole";
  }
  return "?";
}

/// The name the passes give the file in errors: its base name, so the refusals print alike wherever it lies.
std::string base_name(const std::string& path) { return std::filesystem::path(path).filename().string(); }

void torchscript_sections(const std::string& file) {
  const torch::jit::Module original = runtime::load_rank_module(file).module;
  const std::string path = base_name(file);

  section("export root.forward");
  print_graph(*graph_of(original));

  section("classify_parallel_layers");
  const ir::FragmentTable classified = passes::classify_parallel_layers(original, {}, path);
  print_table(classified);
  section("classify_parallel_layers refuses");
  print_refusal([&] {
    auto modules = passes::describe_modules(original, {});
    for (auto& module : modules)
      if (module.path == "mlp.gate_up_proj") module.attributes.erase("output_sizes");
    passes::classify_parallel_layers(modules, {}, path);
  });

  // The body the walk meets for mlp.down_proj: RowParallelLinear.forward with this instance's config folded.
  const torch::jit::Module down = original.attr("mlp").toModule().attr("down_proj").toModule();
  auto& down_forward = torch::jit::toGraphFunction(down.get_method("forward").function());
  section("method_specializer before: RowParallelLinear.forward");
  print_graph(*down_forward.graph());
  section("method_specializer after: method_body(RowParallelLinear.forward, mlp.down_proj)");
  passes::MethodSpecializer specializer;
  print_graph(*specializer.method_body(down_forward, *down._ivalue()));

  section("analyze_location_flow");
  {
    ir::FragmentTable table = classified;
    passes::MethodSpecializer bodies;
    for (const auto& visit : passes::analyze_location_flow(original, table, bodies, path))
      std::cout << visit.location << " " << kind_name(visit.kind) << " (call " << visit.site << " of "
                << (visit.caller_path.empty() ? "root" : visit.caller_path) << ")\n";
    print_table(table);
  }

  section("insert_fragment_ops after: root.forward");
  torch::jit::Module inlined = original.clone();
  ir::FragmentTable table = classified;
  passes::insert_fragment_ops(inlined, table, path);
  print_graph(*graph_of(inlined));

  section("insert_fragment_ops refuses");
  print_refusal([&] {
    ir::FragmentTable again = classified;
    passes::insert_fragment_ops(inlined, again, path);
  });

  section("insert_fragment_ops_per_class after: root.forward");
  torch::jit::Module per_class = original.clone();
  ir::FragmentTable per_class_table = classified;
  const std::string why_inlined = passes::insert_fragment_ops_per_class(per_class, per_class_table, path);
  print_graph(*graph_of(per_class));
  section("insert_fragment_ops_per_class after: LlamaMLP.forward");
  print_graph(*graph_of(per_class.attr("mlp").toModule()));
  std::cout << "inlined instead: " << (why_inlined.empty() ? "no" : why_inlined) << "\n";

  section("inline_fragment_ops after: root.forward");
  passes::inline_fragment_ops(per_class, path);
  print_graph(*graph_of(per_class));

  const ir::LocationTable locations(table);
  section("bind_location_ids: location ids");
  for (size_t id = 0; id < locations.size(); ++id)
    std::cout << id << " " << locations.at(static_cast<ir::LocationId>(id)).name << "\n";
  section("bind_location_ids after: root.forward");
  auto bound = graph_of(inlined)->copy();
  std::cout << "bound " << passes::bind_location_ids(*bound, locations, path) << " ops\n";
  print_graph(*bound);
  section("bind_location_ids refuses");
  print_refusal([&] {
    ir::FragmentTable other = table;
    other.whole.erase(std::find(other.whole.begin(), other.whole.end(), "embed.output"));
    auto copy = graph_of(inlined)->copy();
    passes::bind_location_ids(*copy, ir::LocationTable(other), path);
  });

  section("bind_group_ids after: root.forward");
  std::cout << "bound " << passes::bind_group_ids(*bound, path) << " collectives\n";
  print_graph(*bound);
  section("bind_group_ids refuses");
  print_refusal([&] {
    auto copy = graph_of(inlined)->copy();
    for (auto* node : copy->nodes())
      if (node->kind() == ir::kAllReduceKind) {
        torch::jit::WithInsertPoint guard(node);
        node->replaceInput(1, copy->insertConstant(std::string("pp")));
        break;
      }
    passes::bind_group_ids(*copy, path);
  });

  section("remove_fragment_ops_except {mlp.down_proj.input} after: root.forward");
  auto kept = graph_of(inlined)->copy();
  std::cout << "removed " << passes::remove_fragment_ops_except(*kept, {"mlp.down_proj.input"}) << " op groups\n";
  print_graph(*kept);

  section("remove_fragment_ops refuses");
  print_refusal([&] {
    auto miswired = graph_of(inlined)->copy();
    for (auto* node : miswired->nodes())
      if (node->kind() == c10::Symbol::fromQualString("frag::split")) {
        node->replaceInput(1, node->input(0));  // the split no longer hands back its gather's piece
        break;
      }
    passes::remove_fragment_ops_except(*miswired, {});
  });

  section("remove_all_fragment_ops after: root.forward");
  auto none = graph_of(inlined)->copy();
  std::cout << "removed " << passes::remove_all_fragment_ops(*none) << " op groups\n";
  print_graph(*none);
}

void exported_sections(const std::string& file) {
  const runtime::ExportedProgram program = runtime::read_exported_program(file);
  const std::string path = base_name(file);

  section("export graph (.pt2)");
  print_exported(program.model);

  section("classify_parallel_layers (.pt2)");
  const ir::FragmentTable classified = passes::classify_parallel_layers(program.modules, {}, path);
  print_table(classified);

  section("insert_fragment_ops_pt2 after");
  json model = program.model;
  ir::FragmentTable table = classified;
  passes::insert_fragment_ops_pt2(model, table, path);
  print_exported(model);
  print_table(table);

  section("insert_fragment_ops_pt2 refuses");
  print_refusal([&] {
    json again = model;
    ir::FragmentTable t = classified;
    passes::insert_fragment_ops_pt2(again, t, path);
  });
  print_refusal([&] {
    json unsigned_calls = program.model;
    for (auto& call : unsigned_calls["graph_module"]["module_call_graph"]) call["signature"] = nullptr;
    ir::FragmentTable t = classified;
    passes::insert_fragment_ops_pt2(unsigned_calls, t, path);
  });

  section("bind_location_ids_pt2 after");
  json bound = model;
  std::cout << "bound " << passes::bind_location_ids_pt2(bound, ir::LocationTable(table), path) << " ops\n";
  print_exported(bound);

  section("bind_group_ids_pt2 after");
  std::cout << "bound " << passes::bind_group_ids_pt2(bound, path) << " collectives\n";
  print_exported(bound);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: passes_catalogue RANK0.pt RANK0.pt2\n";
    return 2;
  }
  try {
    torchscript_sections(argv[1]);
    exported_sections(argv[2]);
  } catch (const std::exception& e) {
    std::cerr << "passes_catalogue: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
