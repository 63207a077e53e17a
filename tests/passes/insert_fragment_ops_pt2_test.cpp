//===- tests/passes/insert_fragment_ops_pt2_test.cpp - The .pt2 rewrite, shown as a graph ===//
//
// Graph in (a hand-written models/model.json: an MLP whose up projection is
// column-parallel and down projection row-parallel at tp 2, each module's call
// signature preserved as the kit exports it), pass, FileCheck of the graph
// printed one node a line. Then the table's whole / rank-local lists, the
// inserted nodes' metadata, the outputs, the refusals, and the graph bound to
// location ids (passes/bind_location_ids_pt2).
//
//===----------------------------------------------------------------------===//
#include "passes/insert_fragment_ops_pt2.h"

#include "ir/error.h"
#include "ir/fragment_rule.h"
#include "ir/fragment_table.h"
#include "ir/location_table.h"
#include "passes/bind_location_ids.h"

#include <torch/csrc/jit/testing/file_check.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>

namespace frag::passes {
namespace {

using nlohmann::json;
using torch::jit::testing::FileCheck;

json tensor(const std::string& name) { return {{"as_tensor", {{"name", name}}}}; }

json node(const std::string& target, const std::vector<json>& args, const std::string& out, const std::string& stack) {
  json inputs = json::array();
  for (size_t i = 0; i < args.size(); ++i) inputs.push_back({{"name", "a" + std::to_string(i)}, {"arg", args[i]}, {"kind", 1}});
  json metadata = json::object();
  if (!stack.empty()) metadata["nn_module_stack"] = stack;
  return {{"target", target}, {"inputs", inputs}, {"outputs", {tensor(out)}}, {"metadata", metadata},
          {"is_hop_single_tensor_return", nullptr}, {"name", out}};
}

json meta(int64_t width) {
  const json batch = {{"as_expr", {{"expr_str", "Symbol('s0', positive=True, integer=True)"}, {"hint", {{"as_int", 3}}}}}};
  return {{"dtype", 7}, {"sizes", {batch, {{"as_int", width}}}}, {"strides", {{{"as_int", width}}, {{"as_int", 1}}}},
          {"storage_offset", {{"as_int", 0}}}, {"layout", 7}, {"requires_grad", false},
          {"device", {{"type", "cpu"}, {"index", nullptr}}}};
}

json call(const std::string& fqn, const std::string& input, const std::string& output) {
  return {{"fqn", fqn}, {"signature", {{"inputs", {tensor(input)}}, {"outputs", {tensor(output), {{"as_none", true}}}}}}};
}

/// out = mlp(x) + x, mlp = down(act(up(x))): up column-parallel (its output a shard of 8 columns), down
/// row-parallel (its input a shard, its output all-reduced inside it).
json mlp_model() {
  const std::string mlp = "L__self__mlp,mlp,kit.MLP";
  json nodes = json::array({
      node("torch.ops.aten.linear.default", {tensor("x"), tensor("p_w1")}, "h", mlp + ";L__self__mlp.up,mlp.up,kit.ColumnParallelLinear"),
      node("torch.ops.aten.relu.default", {tensor("h")}, "a", mlp + ";L__self__mlp.act,mlp.act,kit.Act"),
      node("torch.ops.aten.linear.default", {tensor("a"), tensor("p_w2")}, "d", mlp + ";L__self__mlp.down,mlp.down,kit.RowParallelLinear"),
      node("torch.ops.frag.all_reduce.default", {tensor("d"), {{"as_string", "tp"}}}, "z", mlp + ";L__self__mlp.down,mlp.down,kit.RowParallelLinear"),
      node("torch.ops.aten.add.Tensor", {tensor("z"), tensor("x")}, "out", ""),
  });
  json values = {{"x", meta(4)}, {"p_w1", meta(4)}, {"p_w2", meta(4)}, {"h", meta(4)}, {"a", meta(4)},
                 {"d", meta(4)}, {"z", meta(4)}, {"out", meta(4)}};
  json graph = {{"inputs", {tensor("p_w1"), tensor("p_w2"), tensor("x")}}, {"outputs", {tensor("out")}},
                {"nodes", nodes}, {"tensor_values", values}, {"sym_int_values", json::object()}};
  json signature = {{"input_specs", json::array()}, {"output_specs", {{{"user_output", {{"arg", tensor("out")}}}}}}};
  json calls = {{{"fqn", ""}, {"signature", nullptr}}, call("mlp", "x", "z"), call("mlp.up", "x", "h"),
                call("mlp.act", "h", "a"), call("mlp.down", "a", "z")};
  return {{"graph_module", {{"graph", graph}, {"signature", signature}, {"module_call_graph", calls}}},
          {"schema_version", {{"major", 8}, {"minor", 0}}}};
}

ir::FragmentTable mlp_table() {
  ir::FragmentTable table;
  table.tp_size = 2;
  ir::LayerEntry up{"mlp.up", "ColumnParallelLinear", "ColumnParallelLinear", std::nullopt,
                    ir::FragmentedSide{ir::FragmentRule::shard(-1, ir::kTpGroup, 2), 8}, {}};
  ir::LayerEntry down{"mlp.down", "RowParallelLinear", "RowParallelLinear",
                      ir::FragmentedSide{ir::FragmentRule::shard(-1, ir::kTpGroup, 2), 8}, std::nullopt, {}};
  table.layers = {up, down};
  return table;
}

/// One line a node: "out = target(args)"; strings quoted, the rule's JSON shown as "rule".
std::string print(const json& model) {
  const auto& graph = model["graph_module"]["graph"];
  std::string text;
  for (const auto& n : graph["nodes"]) {
    std::string args;
    for (const auto& input : n["inputs"]) {
      const auto& arg = input["arg"];
      if (!args.empty()) args += ", ";
      if (arg.contains("as_tensor")) args += arg["as_tensor"]["name"].get<std::string>();
      else if (arg.contains("as_string")) args += input["name"] == "rule" ? "rule" : "\"" + arg["as_string"].get<std::string>() + "\"";
      else args += arg.begin().value().dump();
    }
    std::string target = n["target"];
    target = target.substr(std::string("torch.ops.").size());
    text += n["outputs"][0]["as_tensor"]["name"].get<std::string>() + " = " + target + "(" + args + ")\n";
  }
  text += "return " + graph["outputs"][0]["as_tensor"]["name"].get<std::string>() + "\n";
  return text;
}

TEST(InsertFragmentOpsPt2, TriplesAtFragmentedBoundariesLoneIntervenesAtWholeOnes) {
  json model = mlp_model();
  auto table = mlp_table();
  insert_fragment_ops_pt2(model, table, "mlp.pt2");
  const std::string graph = print(model);
  FileCheck()
      // x enters mlp, then mlp.up: whole at both.
      .check("frag_x = frag.intervene.default(x, \"mlp.input\", false)")
      ->check_next("frag_x_1 = frag.intervene.default(frag_x, \"mlp.up.input\", false)")
      ->check_next("h = aten.linear.default(frag_x_1, p_w1)")
      // up's output is a shard: gather, intervene, split; act runs on the split's piece.
      ->check_next("frag_h = frag.gather.default(h, \"mlp.up.output\", rule)")
      ->check_next("frag_h_1 = frag.intervene.default(frag_h, \"mlp.up.output\", true)")
      ->check_next("frag_h_2 = frag.split.default(frag_h_1, h, \"mlp.up.output\", rule)")
      ->check_next("a = aten.relu.default(frag_h_2)")
      // act's output (rank-local: no op) is down's input (a shard): a triple.
      ->check_next("frag_a = frag.gather.default(a, \"mlp.down.input\", rule)")
      ->check_next("frag_a_1 = frag.intervene.default(frag_a, \"mlp.down.input\", true)")
      ->check_next("frag_a_2 = frag.split.default(frag_a_1, a, \"mlp.down.input\", rule)")
      ->check_next("d = aten.linear.default(frag_a_2, p_w2)")
      ->check_next("z = frag.all_reduce.default(d, \"tp\")")
      // The all-reduce makes a whole: down's output, then mlp's, on the way to the root's add.
      ->check_next("frag_z = frag.intervene.default(z, \"mlp.down.output\", false)")
      ->check_next("frag_z_1 = frag.intervene.default(frag_z, \"mlp.output\", false)")
      // The root's own use of x is the original x.
      ->check_next("out = aten.add.Tensor(frag_z_1, x)")
      ->check_next("return out")
      ->run(graph);
  FileCheck().check_not("act.input")->check_not("act.output")->run(graph);

  EXPECT_EQ(table.whole, (std::vector<std::string>{"mlp.input", "mlp.up.input", "mlp.down.output", "mlp.output"}));
  ASSERT_EQ(table.rank_local.size(), 2u);
  EXPECT_EQ(table.rank_local[0].location, "mlp.act.input");
  EXPECT_EQ(table.rank_local[0].derived_from, "mlp.up.output");
  EXPECT_EQ(table.rank_local[0].whole_at, "mlp.up.output");  // the split's piece: its whole is read there
  EXPECT_EQ(table.rank_local[1].location, "mlp.act.output");
  EXPECT_EQ(table.rank_local[1].whole_at, "mlp.down.input");  // gathered whole as down's input
}

TEST(InsertFragmentOpsPt2, InsertedNodesCarryMetadataAndTheSignatureFollowsTheOutputs) {
  json model = mlp_model();
  auto table = mlp_table();
  insert_fragment_ops_pt2(model, table, "mlp.pt2");
  const auto& graph = model["graph_module"]["graph"];
  const auto& values = graph["tensor_values"];
  // The gathered whole: 8 columns (the piece has 4), contiguous; the symbolic batch dim kept.
  ASSERT_TRUE(values.contains("frag_h"));
  EXPECT_EQ(values["frag_h"]["sizes"][1]["as_int"], 8);
  EXPECT_EQ(values["frag_h"]["sizes"][0], values["h"]["sizes"][0]);
  EXPECT_EQ(values["frag_h"]["strides"][0]["as_int"], 8);
  EXPECT_EQ(values["frag_h"]["strides"][1]["as_int"], 1);
  EXPECT_EQ(values["frag_h_2"], values["h"]);  // the split's piece is the piece
  EXPECT_EQ(values["frag_z"], values["z"]);
  // Inserted nodes run where the call site is: up's output ops inside mlp, mlp's output ops at the root.
  for (const auto& n : graph["nodes"]) {
    const std::string name = n["name"];
    if (name == "frag_h") {
      EXPECT_EQ(n["metadata"]["nn_module_stack"], "L__self__mlp,mlp,kit.MLP");
    }
    if (name == "frag_z_1") {
      EXPECT_FALSE(n["metadata"].contains("nn_module_stack"));
    }
  }
  EXPECT_EQ(model["graph_module"]["signature"]["output_specs"][0]["user_output"]["arg"], graph["outputs"][0]);
}

TEST(InsertFragmentOpsPt2, InsertedNodesKeepTheGraphsRootEntry) {
  // PyTorch 2.11 starts every stack with the root ("L__self__,,<class>"); torch.export.unflatten needs it
  // on every node that has a stack, so inserted nodes carry it too (at the root: the root alone).
  json model = mlp_model();
  const std::string root = "L__self__,,kit.Model";
  for (auto& n : model["graph_module"]["graph"]["nodes"]) {
    auto& metadata = n["metadata"];
    metadata["nn_module_stack"] =
        metadata.contains("nn_module_stack") ? root + ";" + metadata["nn_module_stack"].get<std::string>() : root;
  }
  auto table = mlp_table();
  insert_fragment_ops_pt2(model, table, "mlp.pt2");
  int checked = 0;
  for (const auto& n : model["graph_module"]["graph"]["nodes"]) {
    const std::string name = n["name"];
    if (name == "frag_h") {
      EXPECT_EQ(n["metadata"]["nn_module_stack"], root + ";L__self__mlp,mlp,kit.MLP");
      ++checked;
    }
    if (name == "frag_z_1") {
      EXPECT_EQ(n["metadata"]["nn_module_stack"], root);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 2);
}

TEST(InsertFragmentOpsPt2, BindingNamesEveryLocationById) {
  // passes::bind_location_ids_pt2, the C++ executor's step (program/pt2_nativert_program): the ops'
  // ".at" overloads, the location an int of the table, no rule text left.
  json model = mlp_model();
  auto table = mlp_table();
  insert_fragment_ops_pt2(model, table, "mlp.pt2");
  const ir::LocationTable locations(table);
  const auto id = [&](const char* name) { return std::to_string(*locations.find(name)); };
  EXPECT_EQ(bind_location_ids_pt2(model, locations, "mlp.pt2"),
            static_cast<int64_t>(3 * 2 + table.whole.size()));
  const std::string text = print(model);
  FileCheck()
      .check("h = aten.linear.default(")
      ->check("frag_h = frag.gather.at(h, " + id("mlp.up.output") + ")")
      ->check("frag_h_1 = frag.intervene.at(frag_h, " + id("mlp.up.output") + ", true)")
      ->check("frag_h_2 = frag.split.at(frag_h_1, h, " + id("mlp.up.output") + ")")
      ->check("frag.gather.at(a, " + id("mlp.down.input") + ")")
      ->check("frag.intervene.at(z, " + id("mlp.down.output") + ", false)")
      ->check_not("frag.gather.default")
      ->check_not("rule")
      ->run(text);
  for (const char* op : {"frag.gather.default", "frag.intervene.default", "frag.split.default"})
    EXPECT_EQ(text.find(op), std::string::npos) << op << " left in\n" << text;
  // Bound again: nothing left in the file's form.
  EXPECT_EQ(bind_location_ids_pt2(model, locations, "mlp.pt2"), 0);
}

TEST(InsertFragmentOpsPt2, BindingRefusesAGraphItsTableDoesNotDescribe) {
  json model = mlp_model();
  auto table = mlp_table();
  insert_fragment_ops_pt2(model, table, "mlp.pt2");
  auto other = table;
  other.layers[0].output->rule = ir::FragmentRule::shard(0, ir::kTpGroup, 2);  // another rule at up.output
  try {
    bind_location_ids_pt2(model, ir::LocationTable(other), "mlp.pt2");
    FAIL() << "bound a graph to a table with another rule";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mlp.pt2: the graph's rule at mlp.up.output differs"), std::string::npos)
        << e.what();
  }
  auto fewer = table;
  fewer.whole.clear();
  try {
    bind_location_ids_pt2(model, ir::LocationTable(fewer), "mlp.pt2");
    FAIL() << "bound a graph with locations its table does not list";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("which its fragment table does not list"), std::string::npos) << e.what();
  }
}

TEST(InsertFragmentOpsPt2, RefusesARewrittenGraph) {
  json model = mlp_model();
  auto table = mlp_table();
  insert_fragment_ops_pt2(model, table, "mlp.pt2");
  EXPECT_TRUE(has_fragment_ops_pt2(model));
  EXPECT_FALSE(has_fragment_ops_pt2(mlp_model()));
  auto again = mlp_table();
  try {
    insert_fragment_ops_pt2(model, again, "mlp.pt2");
    FAIL() << "a rewritten graph was rewritten again";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mlp.pt2: already rewritten"), std::string::npos) << e.what();
  }
}

TEST(InsertFragmentOpsPt2, RefusesAGraphWithoutCallSignatures) {
  json model = mlp_model();
  for (auto& c : model["graph_module"]["module_call_graph"]) c["signature"] = nullptr;
  auto table = mlp_table();
  try {
    insert_fragment_ops_pt2(model, table, "mlp.pt2");
    FAIL() << "no signatures, no boundaries: must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mlp.pt2: module_call_graph keeps no module's call signature"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace frag::passes
