//===- tests/passes/bind_group_ids_test.cpp - Collectives bound to group ids, shown as IR ===//
//
// IR in, bind_group_ids, FileCheck out: every frag::all_reduce / all_gather with a constant group names
// it by ir::GroupId (the ".group" overloads), no group string is left, a computed group is left to be
// looked up by name, and a group no rank connects is refused. The exported twin does the same on a
// graph document. (That the bound kernels compute what the string form did is every model test's: each
// load binds.)
//
//===----------------------------------------------------------------------===//
#include "passes/bind_group_ids.h"

#include "ir/error.h"
#include "ir/group_id.h"
#include "ir/op_schemas.h"

#include <torch/csrc/jit/ir/irparser.h>
#include <torch/csrc/jit/testing/file_check.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace frag::passes {
namespace {

using ::testing::HasSubstr;
using torch::jit::testing::FileCheck;

std::shared_ptr<torch::jit::Graph> parse(const std::string& text) {
  auto graph = std::make_shared<torch::jit::Graph>();
  torch::jit::parseIR(text, graph.get());
  return graph;
}

TEST(BindGroupIds, ConstantGroupsBecomeIds) {
  auto graph = parse(R"IR(
graph(%x : Tensor, %name : str):
  %tp : str = prim::Constant[value="tp"]()
  %ep : str = prim::Constant[value="ep"]()
  %dim : int = prim::Constant[value=-1]()
  %a : Tensor = frag::all_reduce(%x, %tp)
  %b : Tensor = frag::all_gather(%a, %dim, %tp)
  %c : Tensor = frag::all_reduce(%b, %ep)
  %d : Tensor = frag::all_reduce(%c, %name)
  return (%d))IR");
  EXPECT_EQ(bind_group_ids(*graph, "model.pt"), 3);
  const auto tp = std::to_string(static_cast<int>(ir::GroupId::kTp));
  const auto ep = std::to_string(static_cast<int>(ir::GroupId::kEp));
  FileCheck()
      .check("int = prim::Constant[value=" + ep + "]")
      ->check("int = prim::Constant[value=" + tp + "]")
      ->check("frag::all_reduce(%x, ")
      ->check("frag::all_gather(")
      ->check("frag::all_reduce(")
      ->check("frag::all_reduce(")
      ->check_same(", %name)")  // a computed group: looked up by name at run time
      ->check_not("value=\"tp\"")
      ->run(*graph);
  // The bound nodes resolve to the int overloads.
  int bound = 0;
  for (auto* node : graph->nodes()) {
    if (node->kind() != ir::kAllReduceKind && node->kind() != ir::kAllGatherKind) continue;
    const auto& schema = node->schema();
    if (schema.overload_name() == "group") {
      ++bound;
      EXPECT_EQ(schema.arguments().back().type()->kind(), c10::TypeKind::IntType);
    }
  }
  EXPECT_EQ(bound, 3);
  EXPECT_EQ(bind_group_ids(*graph, "model.pt"), 0) << "a bound graph has nothing left to bind";
}

TEST(BindGroupIds, RefusesAGroupNoRankConnects) {
  auto graph = parse(R"IR(
graph(%x : Tensor):
  %pp : str = prim::Constant[value="pp"]()
  %a : Tensor = frag::all_reduce(%x, %pp)
  return (%a))IR");
  try {
    bind_group_ids(*graph, "model.pt");
    FAIL() << "a group no rank connects was bound";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("model.pt: frag::all_reduce names the group 'pp', which no rank connects"));
  }
}

TEST(BindGroupIdsPt2, TargetsAndArgumentsBecomeTheGroupOverloads) {
  auto model = nlohmann::json::parse(R"({"graph_module": {"graph": {"nodes": [
    {"name": "all_reduce", "target": "torch.ops.frag.all_reduce.default",
     "inputs": [{"name": "x", "arg": {"as_tensor": {"name": "d"}}, "kind": 1},
                {"name": "group", "arg": {"as_string": "tp"}, "kind": 1}]},
    {"name": "all_gather", "target": "torch.ops.frag.all_gather.default",
     "inputs": [{"name": "x", "arg": {"as_tensor": {"name": "all_reduce"}}, "kind": 1},
                {"name": "dim", "arg": {"as_int": -1}, "kind": 1},
                {"name": "group", "arg": {"as_string": "tp×ep"}, "kind": 1}]},
    {"name": "linear", "target": "torch.ops.aten.linear.default", "inputs": []}]}}})");
  EXPECT_EQ(bind_group_ids_pt2(model, "model.pt2"), 2);
  const auto& nodes = model["graph_module"]["graph"]["nodes"];
  EXPECT_EQ(nodes[0]["target"], "torch.ops.frag.all_reduce.group");
  EXPECT_EQ(nodes[0]["inputs"][1]["arg"]["as_int"], static_cast<int>(ir::GroupId::kTp));
  EXPECT_EQ(nodes[1]["target"], "torch.ops.frag.all_gather.group");
  EXPECT_EQ(nodes[1]["inputs"][2]["arg"]["as_int"], static_cast<int>(ir::GroupId::kTpEp));
  EXPECT_EQ(nodes[1]["inputs"][1]["arg"]["as_int"], -1) << "other arguments stay";
  EXPECT_EQ(nodes[2]["target"], "torch.ops.aten.linear.default");

  auto bad = nlohmann::json::parse(R"({"graph_module": {"graph": {"nodes": [
    {"name": "r", "target": "torch.ops.frag.all_reduce.default",
     "inputs": [{"name": "group", "arg": {"as_string": "dp"}, "kind": 1}]}]}}})");
  EXPECT_THROW(
      {
        try {
          bind_group_ids_pt2(bad, "model.pt2");
        } catch (const Error& e) {
          EXPECT_THAT(e.what(), HasSubstr("model.pt2: node r (torch.ops.frag.all_reduce.default) names the group 'dp'"));
          throw;
        }
      },
      Error);
}

}  // namespace
}  // namespace frag::passes
