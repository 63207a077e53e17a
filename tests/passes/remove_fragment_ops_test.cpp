//===- tests/passes/remove_fragment_ops_test.cpp - Specializing to locations, shown as IR ===//
//
// Module in, rewrite, remove_fragment_ops_except, FileCheck of the result:
// only the kept locations keep their ops, the model's computation is wired
// back to its own pieces, and the specialized graph runs as the original.
//
//===----------------------------------------------------------------------===//
#include "passes/remove_fragment_ops.h"

#include "ir/error.h"
#include "passes/insert_fragment_ops.h"
#include "ir/location_table.h"
#include "passes/bind_location_ids.h"
#include "passes/classify_parallel_layers.h"
#include "passes/rewrite_for_fragments.h"
#include "runtime/intervention_runtime.h"
#include "tests/passes/pass_fixtures.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/testing/file_check.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sstream>

namespace frag::passes {
namespace {

using namespace frag::passes::testing;
using ::testing::HasSubstr;
using torch::jit::testing::FileCheck;

std::string text_of(const torch::jit::Graph& graph) {
  std::ostringstream os;
  os << graph;
  return os.str();
}

/// Runs `graph` (a copy of root.forward, self first) on `root`.
torch::Tensor run_graph(const Module& root, std::shared_ptr<torch::jit::Graph> graph, const torch::Tensor& x) {
  torch::jit::GraphFunction function("specialized_forward", std::move(graph), nullptr);
  return function({root._ivalue(), x}).toTensor();
}

std::string loc(const std::string& location) { return "[value=\"" + location + "\"]"; }

TEST(RemoveFragmentOps, KeepsOnlyTheNamedLocations) {
  Module root = column_act_row();
  rewrite_for_fragments(root, {}, "chain.pt");
  auto graph = forward_graph(root)->copy();

  // up.input (whole), up.output and down.output go; down.input stays.
  EXPECT_EQ(remove_fragment_ops_except(*graph, {"down.input"}), 3);

  FileCheck()
      .check_not("frag::")
      ->check("aten::linear(")
      ->check_not("frag::")
      ->check("aten::relu(")
      ->check(loc("down.input"))
      ->check("frag::gather(")
      ->check("frag::intervene(")
      ->check("frag::split(")
      ->check("aten::linear(")
      ->check_not("frag::")
      ->check("return")
      ->run(*graph);
  FileCheck().check_count("frag::gather(", 1, /*exactly=*/true)->run(*graph);
  FileCheck().check_not("up.input")->check_not("up.output")->check_not("down.output")->run(*graph);
  EXPECT_NO_THROW(graph->lint());

  // The first linear reads the root's input directly, as before the rewrite.
  for (auto* node : graph->nodes())
    if (node->kind() == c10::Symbol::fromQualString("aten::linear")) {
      EXPECT_EQ(node->input(0), graph->inputs().at(1));
      break;
    }
  // The module's own graph is untouched: the pass works on the copy it is given.
  FileCheck().check(loc("up.input"))->check(loc("up.output"))->check(loc("down.output"))->run(*forward_graph(root));
}

TEST(RemoveFragmentOps, NothingKeptRunsAsTheOriginal) {
  torch::manual_seed(3);
  Module root = column_act_row();
  Module original = root.clone();
  auto locations = std::make_shared<const ir::LocationTable>(rewrite_for_fragments(root, {}, "chain.pt"));
  auto graph = forward_graph(root)->copy();
  EXPECT_EQ(remove_fragment_ops_except(*graph, {}), 4);
  FileCheck().check_not("frag::gather")->check_not("frag::intervene")->check_not("frag::split")->run(*graph);
  EXPECT_NO_THROW(graph->lint());

  auto x = torch::randn({3, 8});
  EXPECT_TRUE(torch::equal(run_graph(root, graph, x), original.forward({x}).toTensor()));

  // A hook at a removed location is not reached: the specialized graph has no op there.
  auto runtime = std::make_shared<runtime::InterventionRuntime>(locations);
  int calls = 0;
  runtime->add("up.output", [&](torch::Tensor&, const runtime::VisitInfo&) {
    ++calls;
    return std::optional<torch::Tensor>();
  });
  runtime::ScopedInterventionRuntime scope(runtime);
  runtime->begin_forward();
  run_graph(root, graph, x);
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(runtime->collectives_at("up.output"), 0);
}

TEST(RemoveFragmentOps, KeptLocationsStillRunTheirHooks) {
  Module root = column_act_row();
  auto locations = std::make_shared<const ir::LocationTable>(rewrite_for_fragments(root, {}, "chain.pt"));
  auto graph = forward_graph(root)->copy();
  remove_fragment_ops_except(*graph, {"up.input"});
  bind_location_ids(*graph, *locations, "chain.pt");  // as a loaded program runs it
  auto runtime = std::make_shared<runtime::InterventionRuntime>(locations);
  std::vector<std::string> seen;
  for (const std::string location : {"up.input", "up.output"})
    runtime->add(location, [&seen](torch::Tensor&, const runtime::VisitInfo& visit) {
      seen.push_back(visit.location);
      return std::optional<torch::Tensor>();
    });
  runtime::ScopedInterventionRuntime scope(runtime);
  runtime->begin_forward();
  run_graph(root, graph, torch::randn({2, 8}));
  EXPECT_EQ(seen, (std::vector<std::string>{"up.input"}));
}

TEST(RemoveFragmentOps, KeepingEveryLocationChangesNothing) {
  Module root = column_act_row();
  rewrite_for_fragments(root, {}, "chain.pt");
  auto graph = forward_graph(root)->copy();
  const std::string before = text_of(*graph);
  EXPECT_EQ(remove_fragment_ops_except(*graph, {"up.input", "up.output", "down.input", "down.output"}), 0);
  EXPECT_EQ(text_of(*graph), before);
}

TEST(RemoveFragmentOps, OpsInsideBranchesAndRepeatedVisits) {
  Module root = holder({{"up", column(2, 0, 8, 8)}});
  define(root, R"(
def forward(self, x):
    if bool(x.sum() > 0):
        h = self.up.forward(x)[0]
    else:
        h = self.up.forward(x * 2.0)[0]
    return h
)");
  Module original = root.clone();
  rewrite_for_fragments(root, {}, "branches.pt");

  auto kept = forward_graph(root)->copy();
  EXPECT_EQ(remove_fragment_ops_except(*kept, {"up.output"}), 2);  // up.input, once per branch
  FileCheck().check_count("frag::split(", 2, /*exactly=*/true)->check_not("up.input")->run(*kept);
  FileCheck().check("prim::If")->check("frag::gather(")->check("frag::gather(")->run(*kept);

  auto none = forward_graph(root)->copy();
  EXPECT_EQ(remove_fragment_ops_except(*none, {}), 4);
  FileCheck().check_not("frag::")->run(*none);
  for (float sign : {1.0f, -1.0f}) {
    auto x = torch::rand({2, 8}) * sign;
    EXPECT_TRUE(torch::equal(run_graph(root, none, x), original.forward({x}).toTensor()));
  }
}

/// The pass must refuse the up.output triple of `graph` and leave the graph as it was.
void expect_up_output_refused(torch::jit::Graph& graph, const std::string& why) {
  const std::string before = text_of(graph);
  try {
    remove_fragment_ops_except(graph, {});
    ADD_FAILURE() << why << " was accepted";
  } catch (const frag::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("up.output"));
    EXPECT_THAT(e.what(), HasSubstr("gather -> intervene -> split"));
  }
  EXPECT_EQ(text_of(graph), before) << "a refused removal changed the graph";
}

TEST(RemoveFragmentOps, RefusesATripleRewiredAfterTheRewrite) {
  Module root = column_act_row();
  rewrite_for_fragments(root, {}, "chain.pt");
  auto graph = forward_graph(root)->copy();
  // Hand the up.output split a different piece than its gather read.
  for (auto* node : graph->nodes())
    if (node->kind() == c10::Symbol::fromQualString("frag::split")) {
      node->replaceInput(1, graph->inputs().at(1));
      break;
    }
  expect_up_output_refused(*graph, "a rewired triple");
}

TEST(RemoveFragmentOps, RefusesATripleWhoseInterveneIsNotFragmented) {
  Module root = column_act_row();
  rewrite_for_fragments(root, {}, "chain.pt");
  auto graph = forward_graph(root)->copy();
  // The middle of the up.output triple claims to open its own visit (a whole location's op).
  for (auto* node : graph->nodes())
    if (node->kind() == c10::Symbol::fromQualString("frag::intervene") &&
        torch::jit::toIValue(node->input(2))->toBool()) {
      torch::jit::WithInsertPoint point(node);
      node->replaceInput(2, graph->insertConstant(false));
      break;
    }
  expect_up_output_refused(*graph, "a triple with a whole-location intervene");
}

TEST(RemoveFragmentOps, AllOfThemInAClassMethodWhoseLocationsComeFromSelf) {
  // A file rewritten per class: the Block's method computes its locations from self._frag_path.
  Module block = holder({{"up", column(2, 0, 8, 16)}, {"act", plain("__torch__.Act", kActSource)}}, "__torch__.Block");
  define(block, "def forward(self, x):\n    return self.act.forward(self.up.forward(x)[0])\n");
  Module root = holder({{"b0", block}, {"b1", block.deepcopy()}});
  define(root, "def forward(self, x):\n    return self.b0.forward(x) + self.b1.forward(x)\n");
  Module original = root.clone();
  ir::FragmentTable table = classify_parallel_layers(root, {}, "file.pt");
  ASSERT_EQ(insert_fragment_ops_per_class(root, table, "file.pt"), "");
  auto method = forward_graph(root.attr("b0").toModule());
  FileCheck().check("frag::gather(")->check("frag::split(")->run(*method);
  // The named form needs constant locations: refused in words, nothing changed.
  const std::string before = method->toString();
  try {
    remove_fragment_ops_except(*method, {});
    FAIL() << "a computed location was accepted";
  } catch (const frag::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("not a constant string"));
  }
  EXPECT_EQ(method->toString(), before);
  // All of them: the triple at up.output and the lone intervene at up.input (act's sides are rank-local).
  EXPECT_EQ(remove_all_fragment_ops(*method), 2);
  FileCheck().check_not("frag::")->run(*method);
  auto x = torch::randn({2, 8});
  EXPECT_TRUE(torch::equal(root.attr("b0").toModule().forward({x}).toTensor(),
                           original.attr("b0").toModule().forward({x}).toTensor()));
}

}  // namespace
}  // namespace frag::passes
