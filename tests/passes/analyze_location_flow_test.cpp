//===- tests/passes/analyze_location_flow_test.cpp - The rewrite's analysis ===//
//
// analyze_location_flow decides, visit by visit, what the rewrite puts at each
// module boundary; insert_fragment_ops builds the graph from those decisions.
// Module in, analysis, visits out; then the rewritten graph holds exactly
// what the visits say, and an insertion given another module's visits is
// refused (an internal error: the two halves run on one module, in one call)
// instead of building a wrong graph.
//
//===----------------------------------------------------------------------===//
#include "passes/analyze_location_flow.h"

#include "ir/error.h"
#include "ir/fragment_table.h"
#include "passes/classify_parallel_layers.h"
#include "passes/insert_fragment_ops.h"
#include "passes/method_specializer.h"
#include "tests/passes/pass_fixtures.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/testing/file_check.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace frag::passes {
namespace {

using namespace frag::passes::testing;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using torch::jit::testing::FileCheck;

/// "fragmented@up.output", "whole@up.input", "rank-local@act.input": the visits in one line.
std::vector<std::string> summary(const std::vector<LocationVisit>& visits) {
  std::vector<std::string> out;
  for (const auto& visit : visits) {
    const char* kind = visit.kind == VisitKind::kFragmented ? "fragmented"
                       : visit.kind == VisitKind::kWhole    ? "whole"
                                                            : "rank-local";
    out.push_back(std::string(kind) + "@" + visit.location);
  }
  return out;
}

struct Analysis {
  ir::FragmentTable table;
  std::vector<LocationVisit> visits;
};

Analysis analyze(const Module& root) {
  Analysis out{classify_parallel_layers(root, {}, "model.pt"), {}};
  MethodSpecializer bodies;
  out.visits = analyze_location_flow(root, out.table, bodies, "model.pt");
  return out;
}

/// The same sequence read back from a rewritten root.forward: per visit, the op that carries its location
/// (a triple's gather, or a lone intervene); a rank-local visit has none.
std::vector<std::string> ops_as_visits(const Module& root) {
  std::vector<std::string> out;
  auto graph = forward_graph(root);
  for (torch::jit::Node* node : graph->nodes()) {
    const std::string kind = node->kind().toQualString();
    if (kind == "frag::gather") {
      out.push_back("fragmented@" + torch::jit::toIValue(node->input(1))->toStringRef());
    } else if (kind == "frag::intervene" && !torch::jit::toIValue(node->input(2))->toBool()) {
      out.push_back("whole@" + torch::jit::toIValue(node->input(1))->toStringRef());
    }
  }
  return out;
}

std::vector<std::string> without_rank_local(const std::vector<std::string>& visits) {
  std::vector<std::string> out;
  for (const auto& visit : visits)
    if (visit.rfind("rank-local@", 0) != 0) out.push_back(visit);
  return out;
}

TEST(AnalyzeLocationFlow, ColumnActRowInVisitOrder) {
  Module root = column_act_row();
  const auto before = forward_graph(root)->toString();
  auto analysis = analyze(root);
  EXPECT_THAT(summary(analysis.visits),
              ElementsAre("whole@up.input", "fragmented@up.output", "rank-local@act.input", "rank-local@act.output",
                          "fragmented@down.input", "fragmented@down.output"));
  // act's input is up's piece: its whole is read at up.output. act's output is the very value gathered
  // whole as down's input.
  ASSERT_EQ(analysis.table.rank_local.size(), 2u);
  EXPECT_EQ(analysis.table.rank_local[0].whole_at, "up.output");
  EXPECT_EQ(analysis.table.rank_local[1].whole_at, "down.input");
  EXPECT_THAT(analysis.table.whole, ElementsAre("up.input"));
  EXPECT_EQ(forward_graph(root)->toString(), before)
      << "the analysis changed the graph";
}

TEST(AnalyzeLocationFlow, AModuleCalledTwiceIsVisitedTwice) {
  Module root = holder({{"up", column(2, 0, 8, 16)}, {"act", plain("__torch__.Act", kActSource)}});
  define(root, R"(
def forward(self, x):
    return self.act.forward(self.up.forward(x)[0]) + self.act.forward(x)
)");
  auto analysis = analyze(root);
  // The same module, once on a piece (rank-local) and once on a whole value.
  EXPECT_THAT(summary(analysis.visits),
              ElementsAre("whole@up.input", "fragmented@up.output", "rank-local@act.input", "rank-local@act.output",
                          "whole@act.input", "whole@act.output"));
  // The table settles a location seen both ways as rank-local.
  EXPECT_TRUE(analysis.table.whole == std::vector<std::string>{"up.input"});
}

TEST(AnalyzeLocationFlow, TheRewriteBuildsWhatTheVisitsSay) {
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(variant);
    auto make = [&] {
      if (variant == 0) return column_act_row();
      Module root = holder({{"embed", vocab_embedding(2, 0, 1000, 8)},
                            {"up", column(2, 0, 8, 16)},
                            {"act", plain("__torch__.Act", kActSource)},
                            {"down", row(2, 0, 16, 8, true, variant == 2)},
                            {"lm_head", lm_head(2, 0, 1000, 8)},
                            {"logits", logits_processor(2, 1000)}});
      define(root, R"(
def forward(self, ids):
    h = self.embed.forward(ids)
    a = self.act.forward(self.up.forward(h)[0])
    d = self.down.forward(a)[0]
    return self.logits.forward(self.lm_head.forward(d))
)");
      return root;
    };
    Module root = make();
    auto analysis = analyze(root);
    ASSERT_FALSE(analysis.visits.empty());
    ir::FragmentTable table = classify_parallel_layers(root, {}, "model.pt");
    insert_fragment_ops(root, table, "model.pt");
    EXPECT_EQ(ops_as_visits(root), without_rank_local(summary(analysis.visits)));
    EXPECT_EQ(ir::to_json(table), ir::to_json(analysis.table)) << "the rewrite's table is the analysis's";
  }
}

TEST(AnalyzeLocationFlow, AnInsertionGivenAnotherModulesVisitsIsRefused) {
  Module root = column_act_row();
  Module other = holder({{"up", column(2, 0, 8, 16)}});
  define(other, "def forward(self, x):\n    return self.up.forward(x)[0]\n");
  auto analysis = analyze(other);
  MethodSpecializer bodies;
  EXPECT_THROW(insert_fragment_ops(root, analysis.table, analysis.visits, bodies, "model.pt"), c10::Error);
  Module again = column_act_row();
  auto own = analyze(again);
  own.visits.pop_back();  // one visit short
  EXPECT_THROW(insert_fragment_ops(again, own.table, own.visits, bodies, "model.pt"), c10::Error);
}

TEST(AnalyzeLocationFlow, RefusesAModuleAlreadyRewritten) {
  Module root = column_act_row();
  ir::FragmentTable table = classify_parallel_layers(root, {}, "model.pt");
  insert_fragment_ops(root, table, "model.pt");
  ASSERT_TRUE(has_fragment_ops(root));
  MethodSpecializer bodies;
  try {
    analyze_location_flow(root, table, bodies, "rank3.pt");
    FAIL() << "a rewritten module was analyzed";
  } catch (const frag::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("rank3.pt"));
    EXPECT_THAT(e.what(), HasSubstr("already rewritten"));
  }
}

TEST(MethodSpecializer, ConfigThatOnlyComputesStaysAReadSoInstancesShareABody) {
  // `slot` differs per instance but only enters computation (as a layer's KV cache slot does); `flip`
  // decides a branch, through arithmetic. Only `flip` is folded: equal flips share one body.
  Module a = make_module("__torch__.Slotted");
  set_int(a, "slot", 0);
  set_int(a, "flip", 1);
  define(a, R"(
def forward(self, x):
    y = x * self.slot
    if self.flip * 2 > 1:
        y = -y
    return y
)");
  Module b = a.deepcopy();
  b.setattr("slot", 1);
  Module c = a.deepcopy();
  c.setattr("slot", 2);
  c.setattr("flip", 0);
  ASSERT_EQ(a.type(), c.type()) << "fixture: one class";
  auto& forward = torch::jit::toGraphFunction(a.get_method("forward").function());
  MethodSpecializer bodies;
  auto body_a = bodies.method_body(forward, *a._ivalue());
  EXPECT_EQ(bodies.method_body(forward, *b._ivalue()), body_a) << "a and b differ only in slot";
  auto body_c = bodies.method_body(forward, *c._ivalue());
  EXPECT_NE(body_c, body_a) << "c's flip takes the other branch";
  for (const auto& body : {body_a, body_c}) {
    FileCheck().check("prim::GetAttr[name=\"slot\"]")->run(*body);
    FileCheck().check_not("prim::If")->check_not("name=\"flip\"")->run(*body);
  }
  FileCheck().check("aten::neg(")->run(*body_a);
  FileCheck().check_not("aten::neg(")->run(*body_c);
}

}  // namespace
}  // namespace frag::passes
