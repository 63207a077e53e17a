//===- tests/passes/bind_location_ids_test.cpp - Ops bound to location ids, shown as IR ===//
//
// Module in, rewrite, bind_location_ids, FileCheck of the result: every
// fragment op names its location by the table's id, no location or rule string
// is left in the graph, the bound graph runs as the original, and a graph
// that its table does not describe is refused.
//
//===----------------------------------------------------------------------===//
#include "passes/bind_location_ids.h"

#include "ir/error.h"
#include "ir/location_table.h"
#include "passes/rewrite_for_fragments.h"
#include "tests/passes/pass_fixtures.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/testing/file_check.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <sstream>

namespace frag::passes {
namespace {

using namespace frag::passes::testing;
using ::testing::HasSubstr;
using torch::jit::testing::FileCheck;

TEST(BindLocationIds, EveryOpNamesItsLocationById) {
  torch::manual_seed(5);
  Module root = column_act_row();
  Module original = root.clone();
  const ir::LocationTable locations(rewrite_for_fragments(root, {}, "chain.pt"));
  // column_act_row: up.output, down.input and down.output (a partial sum)
  // fragmented, up.input whole, act's input and output rank-local.
  ASSERT_EQ(locations.size(), 6u);
  EXPECT_EQ(*locations.find("up.output"), 0) << "ids follow the table: fragmented in layer order first";
  EXPECT_EQ(*locations.find("down.output"), 2);
  EXPECT_EQ(*locations.find("up.input"), 3);
  const auto id = [&](const char* name) { return std::to_string(*locations.find(name)); };
  auto graph = forward_graph(root);
  EXPECT_EQ(bind_location_ids(*graph, locations, "chain.pt"), 1 + 3 * 3);

  FileCheck()
      .check("frag::intervene(")  // up.input, whole
      ->check("aten::linear(")
      ->check("frag::gather(")
      ->check("frag::intervene(")
      ->check("frag::split(")
      ->check("aten::relu(")
      ->check("frag::gather(")  // down.input
      ->check("frag::split(")
      ->check("aten::linear(")
      ->check("frag::gather(")  // down.output
      ->check("frag::split(")
      ->check("return")
      ->run(*graph);
  FileCheck().check("prim::Constant[value=" + id("up.output") + "]")->run(*graph);
  FileCheck().check_not("up.output")->check_not("\"kind\"")->run(*graph);  // no names, no rule JSON left
  for (auto* node : graph->nodes()) {
    if (node->kind() == c10::Symbol::fromQualString("frag::gather")) {
      EXPECT_EQ(node->schema().overload_name(), "at");
    }
  }
  EXPECT_NO_THROW(graph->lint());

  auto x = torch::randn({3, 8});
  EXPECT_TRUE(torch::equal(root.forward({x}).toTensor(), original.forward({x}).toTensor()))
      << "with no runtime the bound ops pass values through";
}

TEST(BindLocationIds, BindingTwiceChangesNothing) {
  Module root = column_act_row();
  const ir::LocationTable locations(rewrite_for_fragments(root, {}, "chain.pt"));
  auto graph = forward_graph(root);
  bind_location_ids(*graph, locations, "chain.pt");
  std::ostringstream before;
  before << *graph;
  EXPECT_EQ(bind_location_ids(*graph, locations, "chain.pt"), 0);
  std::ostringstream after;
  after << *graph;
  EXPECT_EQ(after.str(), before.str());
}

TEST(BindLocationIds, RefusesAGraphItsTableDoesNotDescribe) {
  Module root = column_act_row();
  auto table = rewrite_for_fragments(root, {}, "chain.pt");
  // A table missing a location the graph has.
  auto missing = table;
  missing.whole.erase(std::find(missing.whole.begin(), missing.whole.end(), "up.input"));
  auto copy = forward_graph(root)->copy();
  try {
    bind_location_ids(*copy, ir::LocationTable(missing), "rank0.pt");
    FAIL() << "a location missing from the table was accepted";
  } catch (const frag::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("rank0.pt"));
    EXPECT_THAT(e.what(), HasSubstr("'up.input'"));
    EXPECT_THAT(e.what(), HasSubstr("does not list"));
  }
  // A table whose rule differs from the graph's.
  auto other_rule = table;
  other_rule.layers.at(0).output->rule.group_size += 1;
  copy = forward_graph(root)->copy();
  try {
    bind_location_ids(*copy, ir::LocationTable(other_rule), "rank0.pt");
    FAIL() << "a rule that differs from the table's was accepted";
  } catch (const frag::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("rule at up.output differs"));
  }
}

}  // namespace
}  // namespace frag::passes
