//===- tests/passes/insert_fragment_ops_test.cpp - The rewrite, shown as IR ===//
//
// Module in, pass, FileCheck of the rewritten root graph. Each case builds a
// small root over kit-like layers (pass_fixtures.h), rewrites it with
// rewrite_for_fragments (classification + insert_fragment_ops) and checks
// which frag:: ops sit where, with which location and rule constants; then
// the table's whole / rank-local lists, the graph's lint, and that the
// rewritten module runs bit-identically to the original with no runtime set.
//
//===----------------------------------------------------------------------===//
#include "passes/insert_fragment_ops.h"

#include "ir/error.h"
#include "ir/fragment_rule.h"
#include "ir/fragment_table.h"
#include "ir/location_table.h"
#include "passes/bind_location_ids.h"
#include "passes/classify_parallel_layers.h"
#include "passes/rewrite_for_fragments.h"
#include "runtime/intervention_runtime.h"
#include "tests/passes/pass_fixtures.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/testing/file_check.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

namespace frag::passes {
namespace {

using namespace frag::passes::testing;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using torch::jit::testing::FileCheck;

// ----- helpers ------------------------------------------------------------

/// One inserted frag:: op, read back from the graph.
struct FragOp {
  std::string kind;      ///< "gather", "intervene" or "split"
  std::string location;  ///< the location constant
  std::string rule;      ///< the rule JSON constant (gather, split), else ""
  bool fragmented = false;  ///< intervene's flag
  torch::jit::Node* node = nullptr;
};

std::string constant_string(torch::jit::Value* v) {
  auto iv = torch::jit::toIValue(v);
  EXPECT_TRUE(iv.has_value() && iv->isString()) << "argument is not a constant string";
  return iv && iv->isString() ? iv->toStringRef() : std::string();
}

void collect(torch::jit::Block* block, std::vector<FragOp>& out) {
  for (torch::jit::Node* node : block->nodes()) {
    const std::string kind = node->kind().toQualString();
    if (kind == "frag::gather") {
      out.push_back({"gather", constant_string(node->input(1)), constant_string(node->input(2)), false, node});
    } else if (kind == "frag::intervene") {
      auto flag = torch::jit::toIValue(node->input(2));
      EXPECT_TRUE(flag.has_value() && flag->isBool());
      out.push_back({"intervene", constant_string(node->input(1)), "", flag && flag->toBool(), node});
    } else if (kind == "frag::split") {
      out.push_back({"split", constant_string(node->input(2)), constant_string(node->input(3)), false, node});
    }
    for (torch::jit::Block* inner : node->blocks()) collect(inner, out);
  }
}

/// Every frag:: op of root.forward, in graph order.
std::vector<FragOp> frag_ops(const Module& m) {
  std::vector<FragOp> out;
  collect(forward_graph(m)->block(), out);
  return out;
}

/// "intervene@up.input" / "gather@up.output" …: the op sequence in one line.
std::vector<std::string> op_summary(const std::vector<FragOp>& ops) {
  std::vector<std::string> out;
  for (const auto& op : ops) out.push_back(op.kind + "@" + op.location);
  return out;
}

std::vector<FragOp> ops_at(const std::vector<FragOp>& ops, const std::string& location) {
  std::vector<FragOp> out;
  for (const auto& op : ops)
    if (op.location == location) out.push_back(op);
  return out;
}

/// Checks the gather → intervene → split triple at `location`: constants,
/// rule, and data flow (gather reads the piece, intervene the gathered
/// whole, split the edited whole and the same piece).
void expect_triple(const std::vector<FragOp>& ops, const std::string& location,
                   const ir::FragmentRule& rule, size_t count = 1) {
  SCOPED_TRACE("location " + location);
  auto at = ops_at(ops, location);
  ASSERT_EQ(at.size(), 3 * count);
  for (size_t i = 0; i < count; ++i) {
    const FragOp& gather = at[3 * i];
    const FragOp& intervene = at[3 * i + 1];
    const FragOp& split = at[3 * i + 2];
    EXPECT_EQ(gather.kind, "gather");
    EXPECT_EQ(intervene.kind, "intervene");
    EXPECT_EQ(split.kind, "split");
    EXPECT_TRUE(intervene.fragmented);
    EXPECT_EQ(nlohmann::json::parse(gather.rule), ir::to_json(rule));
    EXPECT_EQ(split.rule, gather.rule);
    EXPECT_EQ(intervene.node->input(0), gather.node->output());
    EXPECT_EQ(split.node->input(0), intervene.node->output());
    EXPECT_EQ(split.node->input(1), gather.node->input(0));
    // The model carries on with the split's piece: the original piece has no
    // other user after the split.
    for (const auto& use : gather.node->input(0)->uses()) {
      if (use.user != gather.node && use.user != split.node) {
        EXPECT_TRUE(use.user->isBefore(gather.node)) << "piece used after the triple: " << *use.user;
      }
    }
  }
}

/// Checks a lone intervene (whole location) at `location`, `count` times.
void expect_whole(const std::vector<FragOp>& ops, const std::string& location, size_t count = 1) {
  SCOPED_TRACE("location " + location);
  auto at = ops_at(ops, location);
  ASSERT_EQ(at.size(), count);
  for (const auto& op : at) {
    EXPECT_EQ(op.kind, "intervene");
    EXPECT_FALSE(op.fragmented);
  }
}

std::vector<std::string> rank_local_pairs(const ir::FragmentTable& table) {
  std::vector<std::string> out;
  for (const auto& local : table.rank_local) out.push_back(local.location + "<-" + local.derived_from);
  return out;
}

std::string graph_text(const Module& m) {
  std::ostringstream os;
  os << *forward_graph(m);
  return os.str();
}

/// The group argument of every frag::all_reduce in root.forward, in order.
std::vector<std::string> all_reduce_groups(const Module& m) {
  std::vector<std::string> out;
  for (auto* node : forward_graph(m)->nodes())
    if (node->kind() == c10::Symbol::fromQualString("frag::all_reduce"))
      out.push_back(constant_string(node->input(1)));
  return out;
}

/// A whole-location constant as printed in the IR: [value="up.input"].
std::string loc(const std::string& location) { return "[value=\"" + location + "\"]"; }

// ----- one case per layer kind ---------------------------------------------

TEST(InsertFragmentOps, ColumnActRowChain) {
  Module root = column_act_row();
  auto table = rewrite_for_fragments(root, {}, "chain.pt");
  auto graph = forward_graph(root);

  // Order and placement, as IR: whole intervene on up's input before the
  // linear; the triple on up's output after it; nothing at act; relu reads
  // the split piece; the triple at down.input feeds down's linear; the
  // partial-sum triple after it.
  FileCheck()
      .check(loc("up.input"))
      ->check("frag::intervene(")
      ->check("aten::linear(")
      ->check(loc("up.output"))
      ->check("frag::gather(")
      ->check_not("aten::")
      ->check("frag::intervene(")
      ->check_not("aten::")
      ->check("frag::split(")
      ->check("prim::TupleIndex(")
      ->check("aten::relu(")
      ->check(loc("down.input"))
      ->check("frag::gather(")
      ->check_not("aten::")
      ->check("frag::split(")
      ->check("aten::linear(")
      ->check(loc("down.output"))
      ->check("frag::gather(")
      ->check_not("aten::")
      ->check("frag::split(")
      ->check("return")
      ->run(*graph);
  FileCheck().check_not("act.input")->check_not("act.output")->run(*graph);
  FileCheck().check_count("\\\"kind\\\":\\\"partial_sum\\\"", 1, /*exactly=*/true)->run(*graph);

  auto ops = frag_ops(root);
  EXPECT_THAT(op_summary(ops),
              ElementsAre("intervene@up.input", "gather@up.output", "intervene@up.output",
                          "split@up.output", "gather@down.input", "intervene@down.input",
                          "split@down.input", "gather@down.output", "intervene@down.output",
                          "split@down.output"));
  expect_whole(ops, "up.input");
  expect_triple(ops, "up.output", ir::FragmentRule::shard(-1, "tp", 2));
  expect_triple(ops, "down.input", ir::FragmentRule::shard(-1, "tp", 2));
  expect_triple(ops, "down.output", ir::FragmentRule::partial_sum("tp", 2));

  // relu reads the piece the up.output split hands back (through the rebuilt tuple).
  auto up_split = ops_at(ops, "up.output")[2].node;
  for (auto* node : graph->nodes())
    if (node->kind() == c10::Symbol::fromQualString("aten::relu")) {
      auto* index = node->input(0)->node();
      ASSERT_EQ(index->kind(), c10::prim::TupleIndex);
      ASSERT_EQ(index->input(0)->node()->kind(), c10::prim::TupleConstruct);
      EXPECT_EQ(index->input(0)->node()->input(0), up_split->output());
    }
  // down's gather reads relu's output directly (act.* is rank-local: no op).
  EXPECT_EQ(ops_at(ops, "down.input")[0].node->input(0)->node()->kind(),
            c10::Symbol::fromQualString("aten::relu"));

  EXPECT_THAT(table.whole, ElementsAre("up.input"));
  EXPECT_THAT(rank_local_pairs(table), ElementsAre("act.input<-up.output", "act.output<-up.output"));
  // Where each rank-local value is whole (issue 16: a plan at act.output was sent to up.output, another
  // value): act's input is the piece up.output's split hands back, act's output is what down.input gathers.
  ASSERT_EQ(table.rank_local.size(), 2u);
  EXPECT_EQ(table.rank_local[0].whole_at, "up.output");
  EXPECT_EQ(table.rank_local[1].whole_at, "down.input");
  EXPECT_EQ(ir::table_from_json(ir::to_json(table), "t").rank_local[1].whole_at, "down.input");
  EXPECT_NO_THROW(graph->lint());
}

TEST(InsertFragmentOps, QkvAndMergedRulesTravelAsJson) {
  Module root = holder({{"qkv_proj", qkv(4, 1, 32, 4, 8, 2)},
                        {"gate_up_proj", merged(4, 1, 32, {24, 24})},
                        {"fused", merged(4, 1, 32, {8, 12, 16})}});
  define(root, R"(
def forward(self, x):
    q = self.qkv_proj.forward(x)[0]
    g = self.gate_up_proj.forward(x)[0]
    f = self.fused.forward(x)[0]
    return (q, g, f)
)");
  auto table = rewrite_for_fragments(root, {}, "fused.pt");
  auto graph = forward_graph(root);
  FileCheck()
      .check(loc("qkv_proj.output"))
      ->check("\\\"kind\\\":\\\"qkv\\\"")
      ->check("frag::gather(")
      ->check(loc("gate_up_proj.output"))
      ->check("\\\"kind\\\":\\\"segments\\\"")
      ->check("frag::gather(")
      ->check(loc("fused.output"))
      ->check("\\\"kind\\\":\\\"segments\\\"")
      ->check("frag::gather(")
      ->run(*graph);

  auto ops = frag_ops(root);
  expect_whole(ops, "qkv_proj.input");
  expect_whole(ops, "gate_up_proj.input");
  expect_whole(ops, "fused.input");
  expect_triple(ops, "qkv_proj.output", ir::FragmentRule::qkv(8, 2, 4, 4, "tp", 4));
  expect_triple(ops, "gate_up_proj.output",
                ir::FragmentRule::segments({24, 24}, {"gate", "up"}, "tp", 4));
  expect_triple(ops, "fused.output", ir::FragmentRule::segments({8, 12, 16}, {}, "tp", 4));
  auto qkv_rule = nlohmann::json::parse(ops_at(ops, "qkv_proj.output")[0].rule);
  EXPECT_EQ(qkv_rule.at("num_heads"), 8);
  EXPECT_EQ(qkv_rule.at("num_kv_heads"), 2);
  EXPECT_EQ(nlohmann::json::parse(ops_at(ops, "gate_up_proj.output")[0].rule).at("segment_names"),
            nlohmann::json({"gate", "up"}));
  EXPECT_THAT(table.whole, ElementsAre("qkv_proj.input", "gate_up_proj.input", "fused.input"));
  EXPECT_TRUE(table.rank_local.empty());
  EXPECT_NO_THROW(graph->lint());
}

TEST(InsertFragmentOps, FusedMoePartialSumOverTpTimesEp) {
  for (auto [tp, ep] : {std::pair<int64_t, int64_t>{2, 1}, {1, 4}}) {
    SCOPED_TRACE("tp " + std::to_string(tp) + " ep " + std::to_string(ep));
    Module root = holder({{"experts", fused_moe(tp, 0, ep, 0, 8, 8, 16, /*reduce_results=*/false)}});
    define(root, R"(
def forward(self, x, router_logits):
    return self.experts.forward(x, router_logits) + x
)");
    auto table = rewrite_for_fragments(root, {}, "moe.pt");
    auto ops = frag_ops(root);
    EXPECT_THAT(op_summary(ops), ElementsAre("intervene@experts.input", "gather@experts.output",
                                             "intervene@experts.output", "split@experts.output"));
    expect_whole(ops, "experts.input");
    expect_triple(ops, "experts.output", ir::FragmentRule::partial_sum(ir::kTpEpGroup, tp * ep));
    // The root's own add reads the split piece.
    FileCheck().check("frag::split(")->check_next("aten::add(")->run(*forward_graph(root));
    EXPECT_THAT(table.whole, ElementsAre("experts.input"));
  }
}

TEST(InsertFragmentOps, ValuesAfterTheBlocksOwnAllReduceAreWhole) {
  // Qwen2-MoE style: the experts leave a partial sum and the block all-reduces
  // it; what follows the model's collective is whole, what precedes it is not.
  Module root = holder({{"experts", fused_moe(2, 0, 1, 0, 8, 8, 16, /*reduce_results=*/false)},
                        {"pre", plain("__torch__.Act", kActSource)},
                        {"post", plain("__torch__.Act", kActSource)}});
  define(root, R"(
def forward(self, x, router_logits):
    partial = self.pre.forward(self.experts.forward(x, router_logits))
    return self.post.forward(torch.ops.frag.all_reduce(partial, "tp"))
)");
  auto table = rewrite_for_fragments(root, {}, "moe.pt");
  auto ops = frag_ops(root);
  EXPECT_TRUE(ops_at(ops, "pre.input").empty());
  EXPECT_TRUE(ops_at(ops, "pre.output").empty());
  expect_whole(ops, "post.input");
  expect_whole(ops, "post.output");
  EXPECT_THAT(rank_local_pairs(table), ElementsAre("pre.input<-experts.output", "pre.output<-experts.output"));
  EXPECT_THAT(table.whole, ElementsAre("experts.input", "post.input", "post.output"));
}

TEST(InsertFragmentOps, FusedMoeReducingItselfHasAWholeOutput) {
  for (auto [tp, ep] : {std::pair<int64_t, int64_t>{2, 1}, {1, 4}}) {
    SCOPED_TRACE("tp " + std::to_string(tp) + " ep " + std::to_string(ep));
    Module root = holder({{"experts", fused_moe(tp, 0, ep, 0, 8, 8, 16, /*reduce_results=*/true)}});
    define(root, R"(
def forward(self, x, router_logits):
    return self.experts.forward(x, router_logits)
)");
    auto table = rewrite_for_fragments(root, {}, "moe.pt");
    auto ops = frag_ops(root);
    EXPECT_THAT(op_summary(ops), ElementsAre("intervene@experts.input", "intervene@experts.output"));
    expect_whole(ops, "experts.output");
    // The reduction runs over the group the config picks (folded: only one branch is left).
    EXPECT_THAT(all_reduce_groups(root), ElementsAre(ep > 1 ? "ep" : "tp"));
    FileCheck().check("frag::all_reduce(")->check(loc("experts.output"))->check("frag::intervene(")
        ->run(*forward_graph(root));
    EXPECT_THAT(table.whole, ElementsAre("experts.input", "experts.output"));
    EXPECT_TRUE(table.rank_local.empty());
  }
}

TEST(InsertFragmentOps, RowReducingThroughTheModelsAllReduceIsWhole) {
  // down's forward runs frag::all_reduce under `if self.reduce_results:`; the
  // pass folds the config, so the branch is known and the output is whole.
  Module root = holder({{"up", column(2, 0, 8, 16)},
                        {"down", row(2, 0, 16, 8, /*input_is_parallel=*/true, /*reduce_results=*/true)}});
  define(root, R"(
def forward(self, x):
    h = self.up.forward(x)[0]
    return self.down.forward(h)[0]
)");
  auto table = rewrite_for_fragments(root, {}, "row.pt");
  auto graph = forward_graph(root);
  FileCheck()
      .check(loc("down.input"))
      ->check("frag::split(")
      ->check("aten::linear(")
      ->check("frag::all_reduce(")
      ->check(loc("down.output"))
      ->check("frag::intervene(")
      ->check_not("frag::gather(")
      ->check("return")
      ->run(*graph);
  // No prim::If survives in the root: the config branches were folded.
  FileCheck().check_not("prim::If")->run(*graph);
  auto ops = frag_ops(root);
  expect_triple(ops, "down.input", ir::FragmentRule::shard(-1, "tp", 2));
  expect_whole(ops, "down.output");
  EXPECT_EQ(ops_at(ops, "down.output")[0].node->input(0)->node()->kind(),
            c10::Symbol::fromQualString("prim::TupleUnpack"));
  EXPECT_THAT(table.whole, ElementsAre("up.input", "down.output"));
  EXPECT_TRUE(table.rank_local.empty());
}

TEST(InsertFragmentOps, RowWithWholeInputGetsAWholeInputIntervene) {
  Module root = holder({{"down", row(2, 0, 16, 8, /*input_is_parallel=*/false, /*reduce_results=*/false)}});
  define(root, "def forward(self, x):\n    return self.down.forward(x)[0]\n");
  auto table = rewrite_for_fragments(root, {}, "row.pt");
  auto ops = frag_ops(root);
  expect_whole(ops, "down.input");
  expect_triple(ops, "down.output", ir::FragmentRule::partial_sum("tp", 2));
  // The layer narrows the whole input itself (tp_rank folded to 0).
  FileCheck().check("frag::intervene(")->check("aten::narrow(")->check("aten::linear(")->run(*forward_graph(root));
}

TEST(InsertFragmentOps, ColumnGatheringItselfHasAWholeOutput) {
  Module root = holder({{"up", column(2, 0, 8, 16, /*gather_output=*/true)}});
  define(root, "def forward(self, x):\n    return self.up.forward(x)[0]\n");
  auto table = rewrite_for_fragments(root, {}, "col.pt");
  auto ops = frag_ops(root);
  EXPECT_THAT(op_summary(ops), ElementsAre("intervene@up.input", "intervene@up.output"));
  expect_whole(ops, "up.output");
  FileCheck().check("frag::all_gather(")->check(loc("up.output"))->check("frag::intervene(")->run(*forward_graph(root));
  EXPECT_THAT(table.whole, ElementsAre("up.input", "up.output"));
}

TEST(InsertFragmentOps, ReplicatedLinearIsWholeOnBothSides) {
  Module root = holder({{"gate", replicated(8, 4)}});
  define(root, "def forward(self, x):\n    return self.gate.forward(x)[0]\n");
  auto table = rewrite_for_fragments(root, {}, "rep.pt");
  auto ops = frag_ops(root);
  EXPECT_THAT(op_summary(ops), ElementsAre("intervene@gate.input", "intervene@gate.output"));
  expect_whole(ops, "gate.input");
  expect_whole(ops, "gate.output");
  FileCheck().check_not("frag::gather")->run(*forward_graph(root));
}

TEST(InsertFragmentOps, VocabEmbeddingLmHeadAndLogits) {
  // embed (whole: it all-reduces) → lm_head (vocab shard) → logits (gathers, drops padding).
  Module root = holder({{"embed", vocab_embedding(2, 0, 1000, 8)},
                        {"lm_head", lm_head(2, 0, 1000, 8)},
                        {"logits", logits_processor(2, 1000)}});
  define(root, R"(
def forward(self, ids):
    h = self.embed.forward(ids)
    return self.logits.forward(self.lm_head.forward(h))
)");
  auto table = rewrite_for_fragments(root, {}, "vocab.pt");
  auto ops = frag_ops(root);
  EXPECT_THAT(op_summary(ops),
              ElementsAre("intervene@embed.input", "intervene@embed.output", "intervene@lm_head.input",
                          "gather@lm_head.output", "intervene@lm_head.output", "split@lm_head.output",
                          "gather@logits.input", "intervene@logits.input", "split@logits.input",
                          "intervene@logits.output"));
  const auto vocab = ir::FragmentRule::vocab_shard(1000, 1024, "tp", 2);
  expect_triple(ops, "lm_head.output", vocab);
  expect_triple(ops, "logits.input", vocab);
  expect_whole(ops, "logits.output");
  FileCheck()
      .check(loc("lm_head.output"))
      ->check("\\\"kind\\\":\\\"vocab_shard\\\"")
      ->check("frag::split(")
      ->check(loc("logits.input"))
      ->check("frag::split(")
      ->check("frag::all_gather(")
      ->check(loc("logits.output"))
      ->check("frag::intervene(")
      ->run(*forward_graph(root));
  EXPECT_THAT(table.whole,
              ElementsAre("embed.input", "embed.output", "lm_head.input", "logits.output"));
}

TEST(InsertFragmentOps, PaddedVocabAtTpOneIsATripleButNotRankLocal) {
  // At tp_size 1 the padded logits still get a triple (it drops the padding),
  // but the one rank holds everything: what follows is whole, not rank-local.
  Module root = holder({{"lm_head", lm_head(1, 0, 1000, 8)}, {"act", plain("__torch__.Act", kActSource)}});
  define(root, "def forward(self, h):\n    return self.act.forward(self.lm_head.forward(h))\n");
  auto table = rewrite_for_fragments(root, {}, "tp1.pt");
  auto ops = frag_ops(root);
  expect_triple(ops, "lm_head.output", ir::FragmentRule::vocab_shard(1000, 1024, "tp", 1));
  expect_whole(ops, "act.input");
  expect_whole(ops, "act.output");
  EXPECT_THAT(table.whole, ElementsAre("lm_head.input", "act.input", "act.output"));
  EXPECT_TRUE(table.rank_local.empty());
}

// ----- instances, call sites, nesting ---------------------------------------

TEST(InsertFragmentOps, InstancesSharingOneClassGetTheirOwnLocations) {
  Module a = column(2, 0, 8, 16);
  Module b = a.deepcopy();
  ASSERT_EQ(a.type(), b.type()) << "fixture: a and b must share one class type";
  ASSERT_EQ(forward_graph(a), forward_graph(b)) << "fixture: one shared method graph";
  Module root = holder({{"a", a}, {"b", b}});
  define(root, R"(
def forward(self, x):
    y = self.a.forward(x)[0]
    z = self.b.forward(x)[0]
    return (y, z)
)");
  auto table = rewrite_for_fragments(root, {}, "shared.pt");
  auto ops = frag_ops(root);
  EXPECT_THAT(op_summary(ops),
              ElementsAre("intervene@a.input", "gather@a.output", "intervene@a.output", "split@a.output",
                          "intervene@b.input", "gather@b.output", "intervene@b.output", "split@b.output"));
  expect_triple(ops, "a.output", ir::FragmentRule::shard(-1, "tp", 2));
  expect_triple(ops, "b.output", ir::FragmentRule::shard(-1, "tp", 2));
  // Each instance's weight feeds its own linear.
  FileCheck()
      .check("prim::GetAttr[name=\"a\"]")
      ->check(loc("a.output"))
      ->check("prim::GetAttr[name=\"b\"]")
      ->check(loc("b.output"))
      ->run(*forward_graph(root));
  // The shared class graph itself is untouched.
  EXPECT_FALSE(has_fragment_ops(root.attr("a").toModule()));
  EXPECT_FALSE(has_fragment_ops(root.attr("b").toModule()));
  EXPECT_EQ(table.layers.size(), 2u);
}

TEST(InsertFragmentOps, ModuleCalledTwiceGetsOpsAtBothCallSites) {
  Module root = holder({{"up", column(2, 0, 8, 16)}});
  define(root, R"(
def forward(self, x):
    return self.up.forward(x)[0] + self.up.forward(x * 2.0)[0]
)");
  auto table = rewrite_for_fragments(root, {}, "twice.pt");
  auto ops = frag_ops(root);
  EXPECT_THAT(op_summary(ops),
              ElementsAre("intervene@up.input", "gather@up.output", "intervene@up.output",
                          "split@up.output", "intervene@up.input", "gather@up.output",
                          "intervene@up.output", "split@up.output"));
  expect_whole(ops, "up.input", /*count=*/2);
  expect_triple(ops, "up.output", ir::FragmentRule::shard(-1, "tp", 2), /*count=*/2);
  // Each call site has its own location constants, the same text twice.
  FileCheck().check_count(loc("up.output"), 2, /*exactly=*/true)->run(*forward_graph(root));
  // The second call's input intervene reads x * 2.0; the add reads both split pieces.
  FileCheck()
      .check("frag::split(")
      ->check("aten::mul(")
      ->check(loc("up.input"))
      ->check("frag::intervene(")
      ->check("frag::split(")
      ->check("aten::add(")
      ->run(*forward_graph(root));
  EXPECT_THAT(table.whole, Contains("up.input"));
  EXPECT_TRUE(table.rank_local.empty());
}

TEST(InsertFragmentOps, NestedModulesGetDottedPaths) {
  // root → block → layer; block returns its layer's call directly.
  Module inner = column(2, 0, 8, 16);
  Module block = holder({{"layer", inner}}, "__torch__.Block");
  define(block, "def forward(self, x):\n    return self.layer.forward(x)\n");
  Module root = holder({{"block", block}, {"act", plain("__torch__.Act", kActSource)}});
  define(root, R"(
def forward(self, x):
    h = self.block.forward(x)[0]
    return self.act.forward(h)
)");
  auto table = rewrite_for_fragments(root, {}, "nested.pt");
  auto ops = frag_ops(root);
  EXPECT_THAT(op_summary(ops),
              ElementsAre("intervene@block.input", "intervene@block.layer.input",
                          "gather@block.layer.output", "intervene@block.layer.output",
                          "split@block.layer.output"));
  expect_triple(ops, "block.layer.output", ir::FragmentRule::shard(-1, "tp", 2));
  EXPECT_THAT(table.whole, ElementsAre("block.input", "block.layer.input"));
  EXPECT_THAT(rank_local_pairs(table),
              ElementsAre("block.output<-block.layer.output", "act.input<-block.layer.output",
                          "act.output<-block.layer.output"));
  // relu reads the split piece, not the raw linear output.
  FileCheck().check("frag::split(")->check("aten::relu(")->check("return")->run(*forward_graph(root));
  ASSERT_NE(table.layer("block.layer"), nullptr);
  EXPECT_NO_THROW(forward_graph(root)->lint());
}

TEST(InsertFragmentOps, ThreeLevelsDeep) {
  Module layer = row(2, 0, 16, 8, true, false);
  Module mlp = holder({{"down_proj", layer}}, "__torch__.Mlp");
  define(mlp, "def forward(self, x):\n    return self.down_proj.forward(x)[0] + 0.0\n");
  Module block = holder({{"mlp", mlp}}, "__torch__.Block");
  define(block, "def forward(self, x):\n    return self.mlp.forward(x)\n");
  Module root = holder({{"layers", block}});
  define(root, "def forward(self, x):\n    return self.layers.forward(x)\n");
  auto table = rewrite_for_fragments(root, {}, "deep.pt");
  auto ops = frag_ops(root);
  expect_triple(ops, "layers.mlp.down_proj.input", ir::FragmentRule::shard(-1, "tp", 2));
  expect_triple(ops, "layers.mlp.down_proj.output", ir::FragmentRule::partial_sum("tp", 2));
  EXPECT_THAT(rank_local_pairs(table),
              ElementsAre("layers.mlp.output<-layers.mlp.down_proj.output",
                          "layers.output<-layers.mlp.down_proj.output"));
}

// ----- running, refusing, analyzing ------------------------------------------

TEST(InsertFragmentOps, RewrittenModuleRunsBitIdentically) {
  torch::manual_seed(7);
  Module root = column_act_row();
  Module original = root.clone();
  rewrite_for_fragments(root, {}, "run.pt");
  ASSERT_TRUE(has_fragment_ops(root));
  ASSERT_FALSE(has_fragment_ops(original));
  auto x = torch::randn({3, 8});
  auto expected = original.forward({x}).toTensor();
  auto actual = root.forward({x}).toTensor();
  EXPECT_TRUE(torch::equal(expected, actual));
  EXPECT_EQ(actual.sizes(), (std::vector<int64_t>{3, 8}));

  // The MoE, a self-reducing row layer (frag::all_reduce runs on the
  // single-rank group) and the vocab path run through too.
  auto same_after_rewrite = [](Module m, const std::vector<c10::IValue>& inputs) {
    Module before = m.clone();
    rewrite_for_fragments(m, {}, "run.pt");
    EXPECT_TRUE(has_fragment_ops(m));
    auto expected = before.forward(inputs).toTensor();
    auto actual = m.forward(inputs).toTensor();
    EXPECT_EQ(expected.sizes(), actual.sizes());
    EXPECT_TRUE(torch::equal(expected, actual));
  };
  Module moe = holder({{"experts", fused_moe(2, 0, 1, 0, 4, 8, 16, false)}});
  define(moe, "def forward(self, x, r):\n    return self.experts.forward(x, r) + x\n");
  same_after_rewrite(moe, {x, torch::randn({3, 4})});

  Module reducing = holder({{"down", row(2, 0, 16, 8, /*input_is_parallel=*/false, /*reduce_results=*/true)}});
  define(reducing, "def forward(self, x):\n    return self.down.forward(x)[0]\n");
  same_after_rewrite(reducing, {torch::randn({3, 16})});

  Module vocab = holder({{"embed", vocab_embedding(2, 0, 1000, 8)},
                         {"lm_head", lm_head(2, 0, 1000, 8)},
                         {"logits", logits_processor(2, 1000)}});
  define(vocab, R"(
def forward(self, ids):
    return self.logits.forward(self.lm_head.forward(self.embed.forward(ids)))
)");
  same_after_rewrite(vocab, {torch::randint(0, 512, {5})});
}

TEST(InsertFragmentOps, RewrittenOpsRunUnderTheRuntime) {
  // A hook at a whole location sees and replaces the value: the inserted ops
  // are the ones the interpreter runs.
  Module root = holder({{"gate", replicated(8, 4)}});
  define(root, "def forward(self, x):\n    return self.gate.forward(x)[0]\n");
  auto locations = std::make_shared<const ir::LocationTable>(rewrite_for_fragments(root, {}, "hook.pt"));
  bind_location_ids(*forward_graph(root), *locations, "hook.pt");  // as a loaded program runs it
  auto runtime = std::make_shared<runtime::InterventionRuntime>(locations);
  int calls = 0;
  runtime->add("gate.input", [&](torch::Tensor& whole, const runtime::VisitInfo& visit) {
    ++calls;
    EXPECT_EQ(visit.rule, nullptr);
    return std::optional<torch::Tensor>(torch::zeros_like(whole));
  });
  runtime::ScopedInterventionRuntime scope(runtime);
  runtime->begin_forward();
  auto out = root.forward({torch::randn({2, 8})}).toTensor();
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(torch::equal(out, torch::zeros({2, 4})));
}

TEST(InsertFragmentOps, RefusesAModuleAlreadyRewritten) {
  Module root = column_act_row();
  EXPECT_FALSE(has_fragment_ops(root));
  auto table = rewrite_for_fragments(root, {}, "model.pt");
  EXPECT_TRUE(has_fragment_ops(root));
  const std::string before = graph_text(root);
  try {
    rewrite_for_fragments(root, {}, "rank0.pt");
    FAIL() << "a second rewrite was accepted";
  } catch (const frag::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("already rewritten"));
    EXPECT_THAT(e.what(), HasSubstr("rank0.pt"));
  }
  EXPECT_EQ(graph_text(root), before) << "a refused rewrite changed the graph";
  // insert_fragment_ops itself refuses too.
  EXPECT_THROW(insert_fragment_ops(root, table, "x.pt"), frag::Error);
}

TEST(InsertFragmentOps, AnalyzeLeavesTheOriginalUnchanged) {
  Module root = column_act_row();
  const std::string before = graph_text(root);
  auto table = analyze_fragments(root, {}, "analyze.pt");
  FileCheck().check_not("frag::gather")->check_not("frag::intervene")->run(*forward_graph(root));
  FileCheck().check("prim::CallMethod[name=\"forward\"]")->run(*forward_graph(root));
  EXPECT_EQ(graph_text(root), before);
  EXPECT_FALSE(has_fragment_ops(root));
  // Same table as the rewrite gives.
  Module copy = column_act_row();
  auto rewritten = rewrite_for_fragments(copy, {}, "analyze.pt");
  EXPECT_EQ(ir::to_json(table), ir::to_json(rewritten));
  EXPECT_THAT(rank_local_pairs(table), ElementsAre("act.input<-up.output", "act.output<-up.output"));
  // The original is still rewritable afterwards.
  EXPECT_NO_THROW(rewrite_for_fragments(root, {}, "analyze.pt"));
}

TEST(InsertFragmentOps, RewriteDoesNotDependOnTheRank) {
  Module rank0 = column_act_row(0);
  Module rank1 = column_act_row(1);
  auto table0 = rewrite_for_fragments(rank0, {}, "rank0.pt");
  auto table1 = rewrite_for_fragments(rank1, {}, "rank1.pt");
  EXPECT_EQ(ir::to_json(table0), ir::to_json(table1));
  auto ops0 = frag_ops(rank0);
  auto ops1 = frag_ops(rank1);
  ASSERT_EQ(op_summary(ops0), op_summary(ops1));
  for (size_t i = 0; i < ops0.size(); ++i) {
    EXPECT_EQ(ops0[i].rule, ops1[i].rule);
    EXPECT_EQ(ops0[i].fragmented, ops1[i].fragmented);
  }
}

// ----- the file form: ops in each class's own methods ------------------------

/// Two instances of one Block class (one method graph), each holding an up (Column) → act → down (Row)
/// chain, under a root that calls both.
Module two_shared_blocks() {
  Module block = holder({{"up", column(2, 0, 8, 16)},
                         {"act", plain("__torch__.Act", kActSource)},
                         {"down", row(2, 0, 16, 8, /*input_is_parallel=*/true, /*reduce_results=*/true)}},
                        "__torch__.Block");
  define(block, R"(
def forward(self, x):
    return self.down.forward(self.act.forward(self.up.forward(x)[0]))[0]
)");
  Module other = block.deepcopy();
  Module root = holder({{"b0", block}, {"b1", other}});
  define(root, "def forward(self, x):\n    return self.b1.forward(self.b0.forward(x))\n");
  return root;
}

std::shared_ptr<torch::jit::Graph> method_graph(const Module& m) { return forward_graph(m); }

TEST(InsertFragmentOpsPerClass, OpsGoIntoTheSharedMethodWithLocationsFromSelf) {
  Module root = two_shared_blocks();
  Module b0 = root.attr("b0").toModule();
  ASSERT_EQ(b0.type(), root.attr("b1").toModule().type()) << "fixture: one Block class";
  ir::FragmentTable table = classify_parallel_layers(root, {}, "file.pt");
  EXPECT_EQ(insert_fragment_ops_per_class(root, table, "file.pt"), "");
  // The Block's one graph: up.output a triple, act's sides rank-local (no op), down's input a triple, its
  // output whole (down reduces) — each location self._frag_path + the rest.
  FileCheck()
      .check_count("prim::GetAttr[name=\"_frag_path\"]", 1, /*exactly=*/true)
      ->run(*method_graph(b0));
  FileCheck()
      .check("prim::GetAttr[name=\"_frag_path\"]")
      ->check("prim::CallMethod[name=\"forward\"]")
      ->check("[value=\".up.output\"]")
      ->check("aten::add(")
      ->check("frag::gather(")
      ->check("frag::intervene(")
      ->check("frag::split(")
      ->check("[value=\".down.input\"]")
      ->check("frag::split(")
      ->check("prim::CallMethod[name=\"forward\"]")
      ->check("[value=\".down.output\"]")
      ->check("frag::intervene(")
      ->check_not("frag::gather(")
      ->run(*method_graph(b0));
  FileCheck().check_not(".act.")->run(*method_graph(b0));
  // Each instance names itself; the root's own calls get constant locations.
  EXPECT_EQ(b0.attr("_frag_path").toStringRef(), "b0");
  EXPECT_EQ(root.attr("b1").toModule().attr("_frag_path").toStringRef(), "b1");
  FileCheck()
      .check("[value=\"b0.input\"]")
      ->check("prim::CallMethod[name=\"forward\"]")
      ->check("[value=\"b0.output\"]")
      ->check("[value=\"b1.input\"]")
      ->run(*forward_graph(root));
  // The layers' own methods are untouched; the table is the inlining rewrite's.
  EXPECT_FALSE(has_fragment_ops(root.attr("b0").toModule().attr("up").toModule()));
  Module inlined = two_shared_blocks();
  EXPECT_EQ(ir::to_json(table), ir::to_json(rewrite_for_fragments(inlined, {}, "file.pt")));
  EXPECT_TRUE(has_fragment_ops(root));
  EXPECT_TRUE(is_rewritten_per_class(root));
  EXPECT_FALSE(is_rewritten_per_class(inlined));
  method_graph(b0)->lint();
  forward_graph(root)->lint();
}

TEST(InsertFragmentOpsPerClass, RunsAsTheOriginalAndInlinesAtLoadToTheInliningRewrite) {
  torch::manual_seed(3);
  Module root = two_shared_blocks();
  Module original = root.clone();
  ir::FragmentTable table = classify_parallel_layers(root, {}, "file.pt");
  ASSERT_EQ(insert_fragment_ops_per_class(root, table, "file.pt"), "");
  const auto x = torch::randn({3, 8});
  const auto expected = original.forward({x}).toTensor();
  EXPECT_TRUE(torch::equal(root.forward({x}).toTensor(), expected)) << "the file form runs as the export";
  // Saved and loaded as frag rewrite writes it: the path attributes travel with the instances.
  std::stringstream file;
  root.save(file);
  Module loaded = torch::jit::load(file);
  ASSERT_TRUE(is_rewritten_per_class(loaded));
  inline_fragment_ops(loaded, "file.pt");
  Module inlined = two_shared_blocks();
  rewrite_for_fragments(inlined, {}, "file.pt");
  EXPECT_EQ(op_summary(frag_ops(loaded)), op_summary(frag_ops(inlined)));
  auto ops = frag_ops(loaded);
  expect_triple(ops, "b1.up.output", ir::FragmentRule::shard(-1, "tp", 2));
  expect_triple(ops, "b0.down.input", ir::FragmentRule::shard(-1, "tp", 2));
  expect_whole(ops, "b1.down.output");
  FileCheck().check_not("prim::CallMethod")->check_not("_frag_path")->check_not("aten::add(str")->run(
      *forward_graph(loaded));
  forward_graph(loaded)->lint();
  // Every other method is the export's own again (ad-hoc calls run them).
  EXPECT_FALSE(has_fragment_ops(loaded.attr("b0").toModule()));
  EXPECT_FALSE(is_rewritten_per_class(loaded));
  EXPECT_TRUE(torch::equal(loaded.forward({x}).toTensor(), expected));
  EXPECT_TRUE(torch::equal(loaded.attr("b1").toModule().forward({x}).toTensor(),
                           original.attr("b1").toModule().forward({x}).toTensor()));
  // A rewritten file is refused by a second rewrite, either form.
  EXPECT_THROW(rewrite_for_file(loaded, {}, "again.pt"), frag::Error);
  Module again = two_shared_blocks();
  rewrite_for_file(again, {}, "file.pt");
  EXPECT_THROW(rewrite_for_file(again, {}, "again.pt"), frag::Error);
}

TEST(InsertFragmentOpsPerClass, InstancesNeedingDifferentOpsFallBackToInlining) {
  // b0's act sees a piece (rank-local), b1's act a whole value: one call site of the Act-calling class,
  // two treatments.
  Module block = holder({{"act", plain("__torch__.Act", kActSource)}}, "__torch__.Wrap");
  define(block, "def forward(self, x):\n    return self.act.forward(x)\n");
  Module other = block.deepcopy();
  Module root = holder({{"up", column(2, 0, 8, 16)}, {"b0", block}, {"b1", other}});
  define(root, "def forward(self, x):\n    return self.b0.forward(self.up.forward(x)[0]) + self.b1.forward(x)\n");
  ir::FragmentTable table = classify_parallel_layers(root, {}, "mixed.pt");
  const std::string why = insert_fragment_ops_per_class(root, table, "mixed.pt");
  EXPECT_THAT(why, HasSubstr("act.input"));
  EXPECT_THAT(why, HasSubstr("differ"));
  // Rewritten by inlining instead: nothing in the classes, every op in root.forward.
  EXPECT_FALSE(is_rewritten_per_class(root));
  EXPECT_FALSE(has_fragment_ops(root.attr("b0").toModule()));
  EXPECT_THAT(op_summary(frag_ops(root)), Contains("intervene@b1.act.input"));
  FileCheck().check_not("prim::CallMethod")->run(*forward_graph(root));
}

}  // namespace
}  // namespace frag::passes
