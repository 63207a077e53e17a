//===- tests/runtime/sharded_model_test.cpp - Interventions vs the tp=1 model ===//
//
// Ranks run as threads, each a ShardedModel over real Gloo. The tp=1 export of
// the same weights is the ground truth: every saved value must equal its
// value, and every edit must change the tp=N logits exactly as the same edit
// changes the tp=1 logits.
//
//===----------------------------------------------------------------------===//
#include "ir/error.h"
#include "ir/op_schemas.h"
#include "runtime/safetensors.h"
#include "program/sharded_model.h"
#include "tests/support/model_ranks.h"
#include "tests/support/test_support.h"

#include <gtest/gtest.h>
#include <torch/csrc/jit/ir/ir.h>

namespace frag::program {
namespace {

using namespace frag::runtime;

using namespace std::chrono_literals;
using testing::model_files;
using testing::on_ranks;
using testing::temporary_folder;

/// Tolerances for fp32: a tp=N run sums in another order than tp=1.
constexpr double kValueTolerance = 2e-5;
constexpr double kLogitTolerance = 1e-4;

torch::Tensor token_ids() {
  return torch::tensor({1, 2, 3, 4, 5, 6, 7, 8, 999, 17, 42, 63, 64, 65, 500, 0}, torch::kLong).reshape({2, 8});
}

void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

/// Logits and saves of rank 0 after applying `plan_json` (or no plan when empty).
struct Result {
  torch::Tensor logits;
  SavedTensors saved;
};

Result run_plan(const std::string& export_name, const nlohmann::json& plan_json, const std::string& base) {
  Result result;
  expect_no_errors(on_ranks(export_name, [&](int rank, ShardedModel& model) {
    if (!plan_json.is_null()) model.apply(Plan::from_json(plan_json, "test plan", base));
    auto logits = model.forward(token_ids());
    if (rank == 0) {
      result.logits = logits;
      result.saved = model.saved();
    }
  }));
  return result;
}

struct Pair {
  const char* whole;
  const char* sharded;
};

class Equivalence : public ::testing::TestWithParam<Pair> {};

/// The llama exports with the GPT-NeoX style MLP (tests/models/BUILD: --mlp plain): up_proj is a plain
/// ColumnParallelLinear (gather_output=False), GELU, then down_proj.
bool is_plain_mlp(const std::string& name) { return name.rfind("llama_plain_mlp", 0) == 0; }

/// Every location kind the model has: whole, fragmented of each layout.
std::vector<std::string> save_locations(const std::string& name) {
  std::vector<std::string> locations = {
      "model.embed_tokens.output",                  // whole
      "model.layers.0.output",                      // whole
      "model.layers.0.self_attn.qkv_proj.output",   // QKV segments
      "model.layers.0.self_attn.o_proj.input",      // row input shard
      "model.layers.1.self_attn.qkv_proj.output",
      "lm_head.output",                             // vocab shard
  };
  if (is_plain_mlp(name)) {
    locations.push_back("model.layers.0.mlp.up_proj.output");  // plain column output: shard(-1)
    locations.push_back("model.layers.1.mlp.up_proj.output");
    locations.push_back("model.layers.1.mlp.down_proj.input");
  } else if (name.rfind("llama", 0) == 0) {
    locations.push_back("model.layers.0.mlp.gate_up_proj.output");  // merged segments
    locations.push_back("model.layers.1.mlp.down_proj.input");
  } else {
    locations.push_back("model.layers.0.mlp.experts.output");                      // MoE partial sum
    locations.push_back("model.layers.0.mlp.shared_expert.gate_up_proj.output");   // merged
    locations.push_back("model.layers.0.mlp.shared_expert.down_proj.input");       // row input
    locations.push_back("model.layers.1.mlp.shared_expert.down_proj.output");      // row partial sum
  }
  return locations;
}

TEST_P(Equivalence, SavedValuesEqualTheTp1Values) {
  FRAG_REQUIRE_GLOO();
  nlohmann::json plan = nlohmann::json::array();
  for (const auto& location : save_locations(GetParam().sharded))
    plan.push_back({{"at", location}, {"do", "save"}, {"as", location}});
  auto whole = run_plan(GetParam().whole, plan, "");
  auto sharded = run_plan(GetParam().sharded, plan, "");
  for (const auto& location : save_locations(GetParam().sharded)) {
    ASSERT_EQ(sharded.saved.count(location), 1u) << location;
    const auto& expected = whole.saved.at(location).at(0);
    const auto& actual = sharded.saved.at(location).at(0);
    ASSERT_EQ(actual.sizes(), expected.sizes()) << location;
    EXPECT_LT((actual - expected).abs().max().item<double>(), kValueTolerance) << location;
  }
}

TEST_P(Equivalence, EditsChangeTheLogitsAsAtTp1) {
  FRAG_REQUIRE_GLOO();
  auto folder = temporary_folder();
  torch::manual_seed(3);
  write_safetensors(folder + "/values.safetensors",
                    {{"steer", torch::randn({64})}, {"row_in", torch::randn({2, 8, 128}) * 0.5},
                     {"psum", torch::randn({16, 64})}});
  const bool plain_mlp = is_plain_mlp(GetParam().sharded);
  const bool llama = !plain_mlp && std::string(GetParam().sharded).rfind("llama", 0) == 0;
  std::vector<nlohmann::json> edits = {
      // across the q/k boundary (q is 64 wide)
      {{"at", "model.layers.0.self_attn.qkv_proj.output"}, {"do", "zero"}, {"index", "...,56:72"}},
      {{"at", "model.layers.1.output"}, {"do", "add"}, {"value", "values.safetensors:steer"}},
      {{"at", "model.layers.0.self_attn.o_proj.input"}, {"do", "scale"}, {"by", 1.5}, {"index", "...,8:40"}},
      {{"at", "lm_head.output"}, {"do", "scale"}, {"by", 2.0}, {"index", "...,0:500"}},
  };
  if (plain_mlp) {
    // Slices of the plain column output that cross the boundaries between rank pieces: the whole width
    // (from the tp=1 run) and the rank count (from the export) give the piece width.
    const std::string up = "model.layers.0.mlp.up_proj.output";
    const int64_t width = run_plan(GetParam().whole, nlohmann::json::array({{{"at", up}, {"do", "save"}, {"as", "up"}}}),
                                   "").saved.at("up").at(0).size(-1);
    const int64_t ranks = static_cast<int64_t>(model_files(GetParam().sharded).size());
    ASSERT_EQ(width % ranks, 0);
    const int64_t piece = width / ranks;  // rank r holds [r*piece, (r+1)*piece)
    ASSERT_GE(piece, 16);
    auto slice = [](int64_t a, int64_t b) { return "...," + std::to_string(a) + ":" + std::to_string(b); };
    const int64_t last = (ranks - 1) * piece;  // the boundary before the last rank's piece
    write_safetensors(folder + "/up.safetensors",
                      {{"set", torch::randn({2, 8, 16}) * 2}, {"add", torch::randn({12}) * 3}});
    edits.push_back({{"at", up}, {"do", "zero"}, {"index", slice(piece - 8, piece + 8)}});          // ranks 0|1
    edits.push_back({{"at", up}, {"do", "scale"}, {"by", -2.0}, {"index", slice(piece / 2, width - piece / 2)}});  // all
    edits.push_back({{"at", up}, {"do", "set"}, {"value", "up.safetensors:set"}, {"index", slice(last - 5, last + 11)}});
    edits.push_back({{"at", "model.layers.1.mlp.up_proj.output"}, {"do", "add"}, {"value", "up.safetensors:add"},
                     {"index", slice(piece - 3, piece + 9)}});
    edits.push_back({{"at", "model.layers.1.mlp.down_proj.input"}, {"do", "set"}, {"value", "values.safetensors:row_in"}});
  } else if (llama) {
    // across the gate/up boundary (gate is 128 wide)
    edits.push_back({{"at", "model.layers.0.mlp.gate_up_proj.output"}, {"do", "scale"}, {"by", -0.5}, {"index", "...,120:136"}});
    edits.push_back({{"at", "model.layers.1.mlp.down_proj.input"}, {"do", "set"}, {"value", "values.safetensors:row_in"}});
  } else {
    edits.push_back({{"at", "model.layers.0.mlp.experts.output"}, {"do", "set"}, {"value", "values.safetensors:psum"}});
    edits.push_back({{"at", "model.layers.1.mlp.shared_expert.down_proj.output"}, {"do", "scale"}, {"by", 3.0}});
    edits.push_back({{"at", "model.layers.1.mlp.shared_expert.gate_up_proj.output"}, {"do", "zero"}, {"index", "...,60:70"}});
  }
  auto baseline = run_plan(GetParam().whole, nullptr, folder).logits;
  for (const auto& edit : edits) {
    nlohmann::json plan = nlohmann::json::array({edit});
    auto expected = run_plan(GetParam().whole, plan, folder).logits;
    auto actual = run_plan(GetParam().sharded, plan, folder).logits;
    EXPECT_GT((expected - baseline).abs().max().item<double>(), 1e-3) << "the edit must matter: " << edit.dump();
    EXPECT_LT((actual - expected).abs().max().item<double>(), kLogitTolerance) << edit.dump();
  }
}

TEST_P(Equivalence, AReadOnlyPlanGivesBitIdenticalLogits) {
  FRAG_REQUIRE_GLOO();
  nlohmann::json plan = nlohmann::json::array();
  for (const auto& location : save_locations(GetParam().sharded))
    plan.push_back({{"at", location}, {"do", "save"}, {"as", location}});
  auto plain = run_plan(GetParam().sharded, nullptr, "").logits;
  auto reading = run_plan(GetParam().sharded, plan, "").logits;
  EXPECT_TRUE(torch::equal(plain, reading));
}

INSTANTIATE_TEST_SUITE_P(ReferenceModels, Equivalence,
                         ::testing::Values(Pair{"llama_tp1", "llama_tp2"}, Pair{"llama_kv2_tp1", "llama_kv2_tp4"},
                                           Pair{"llama_plain_mlp_tp1", "llama_plain_mlp_tp2"},
                                           Pair{"llama_plain_mlp_tp1", "llama_plain_mlp_tp4"},
                                           Pair{"moe_tp1", "moe_tp2"}, Pair{"moe_tp1", "moe_tp4"},
                                           Pair{"moe_tp1", "moe_ep_tp2"}),
                         [](const auto& info) { return std::string(info.param.sharded); });

TEST(OncePerVisit, ManyInterventionsAtOneLocationCostOneCollective) {
  FRAG_REQUIRE_GLOO();
  const std::string busy = "model.layers.0.self_attn.qkv_proj.output";
  const std::string idle = "model.layers.1.self_attn.qkv_proj.output";
  expect_no_errors(on_ranks("llama_tp2", [&](int, ShardedModel& model) {
    std::vector<torch::Tensor> seen;
    for (int i = 0; i < 4; ++i)
      model.on(busy, [&seen](torch::Tensor& whole, const VisitInfo&) -> std::optional<torch::Tensor> {
        seen.push_back(whole);
        return std::nullopt;
      }, std::nullopt, "reader", /*edits=*/false);
    auto& group = model.context().group("tp");
    const int64_t before = group.collective_count();
    model.forward(token_ids());
    EXPECT_EQ(model.interventions().collectives_at(busy), 1);
    EXPECT_EQ(model.interventions().collectives_at(idle), 0);
    ASSERT_EQ(seen.size(), 4u);
    for (const auto& t : seen) EXPECT_EQ(t.data_ptr(), seen[0].data_ptr()) << "all see the one whole tensor";
    // The model's own collectives plus exactly one gather.
    model.clear();
    const int64_t plain_before = group.collective_count();
    model.forward(token_ids());
    const int64_t plain = group.collective_count() - plain_before;
    EXPECT_EQ(plain_before - before, plain + 1);
  }));
}

TEST(OncePerVisit, ManyInterventionsAtAPlainColumnOutputCostOneCollective) {
  FRAG_REQUIRE_GLOO();
  // up_proj.output of the plain MLP is a shard(-1) fragment: several readers and an editor at one
  // visit share one gather (the split back after the edit is local).
  const std::string busy = "model.layers.0.mlp.up_proj.output";
  const std::string idle = "model.layers.1.mlp.up_proj.output";
  for (const std::string name : {"llama_plain_mlp_tp2", "llama_plain_mlp_tp4"}) {
    SCOPED_TRACE(name);
    const int64_t ranks = static_cast<int64_t>(model_files(name).size());
    expect_no_errors(on_ranks(name, [&](int, ShardedModel& model) {
      std::vector<torch::Tensor> seen;
      for (int i = 0; i < 3; ++i)
        model.on(busy, [&seen](torch::Tensor& whole, const VisitInfo&) -> std::optional<torch::Tensor> {
          seen.push_back(whole);
          return std::nullopt;
        }, std::nullopt, "reader", /*edits=*/false);
      model.on(busy, [](torch::Tensor& whole, const VisitInfo&) -> std::optional<torch::Tensor> {
        return whole * 0.5;
      }, std::nullopt, "editor", /*edits=*/true);
      model.save(busy, "up");
      auto& group = model.context().group("tp");
      const int64_t before = group.collective_count();
      model.forward(token_ids());
      const int64_t with_hooks = group.collective_count() - before;
      EXPECT_EQ(model.interventions().collectives_at(busy), 1);
      EXPECT_EQ(model.interventions().collectives_at(idle), 0);
      EXPECT_EQ(model.interventions().visits_at(busy), 1);
      ASSERT_EQ(seen.size(), 3u);
      for (const auto& t : seen) EXPECT_EQ(t.data_ptr(), seen[0].data_ptr()) << "all see the one whole tensor";
      EXPECT_EQ(seen[0].size(-1), 128) << "the whole intermediate, not a piece";
      EXPECT_EQ(seen[0].size(-1) % ranks, 0);
      ASSERT_EQ(model.saved().count("up"), 1u);
      EXPECT_EQ(model.saved().at("up").at(0).sizes(), seen[0].sizes());
      // The model's own collectives plus exactly one gather.
      model.clear();
      const int64_t plain_before = group.collective_count();
      model.forward(token_ids());
      EXPECT_EQ(with_hooks, group.collective_count() - plain_before + 1);
    }));
  }
}

TEST(OncePerVisit, NothingWaitingCostsNoCollective) {
  FRAG_REQUIRE_GLOO();
  expect_no_errors(on_ranks("moe_tp2", [&](int, ShardedModel& model) {
    auto& group = model.context().group("tp");
    const int64_t before = group.collective_count();
    model.forward(token_ids());
    const int64_t rewritten = group.collective_count() - before;
    // The model's own: 1 embedding + per layer (o_proj + MoE block) + logits gather = 6.
    EXPECT_EQ(rewritten, 6);
    for (const auto& location : save_locations("moe_tp2")) EXPECT_EQ(model.interventions().collectives_at(location), 0);
  }));
}

TEST(OncePerVisit, VisitIndexSelectsOneCall) {
  FRAG_REQUIRE_GLOO();
  expect_no_errors(on_ranks("llama_tp2", [&](int, ShardedModel& model) {
    model.save("model.layers.0.mlp.down_proj.input", "first", 0);
    model.save("model.layers.0.mlp.down_proj.input", "second", 1);  // called once: never visited
    model.forward(token_ids());
    EXPECT_EQ(model.saved().count("first"), 1u);
    EXPECT_EQ(model.saved().count("second"), 0u);
    EXPECT_EQ(model.interventions().visits_at("model.layers.0.mlp.down_proj.input"), 1);
  }));
}

TEST(Specialization, RunsAsTheFullRewriteWithAndWithoutInterventions) {
  FRAG_REQUIRE_GLOO();
  for (const std::string name : {"llama_tp2", "moe_tp2"}) {
    SCOPED_TRACE(name);
    expect_no_errors(on_ranks(name, [&](int, ShardedModel& model) {
      // (What the specialized graph holds is shown in tests/passes/remove_fragment_ops_test.)
      const auto plain_specialized = model.forward(token_ids());
      model.set_specialize(false);
      const auto plain_full = model.forward(token_ids());
      EXPECT_TRUE(torch::equal(plain_specialized, plain_full));

      for (const auto& location : save_locations(name)) model.save(location, location);
      model.on("model.layers.1.output", [](torch::Tensor& whole, const VisitInfo&) -> std::optional<torch::Tensor> {
        whole.mul_(0.5);
        return std::nullopt;
      });
      const auto edited_full = model.forward(token_ids());
      const SavedTensors saved_full = model.saved();
      model.clear_saved();
      model.set_specialize(true);
      const auto edited_specialized = model.forward(token_ids());
      EXPECT_FALSE(torch::equal(edited_full, plain_full)) << "the edit must matter";
      EXPECT_TRUE(torch::equal(edited_specialized, edited_full));
      ASSERT_EQ(model.saved().size(), saved_full.size());
      for (const auto& [location, values] : saved_full)
        EXPECT_TRUE(torch::equal(model.saved().at(location).at(0), values.at(0))) << location;
    }));
  }
}

/// frag:: ops in a graph, nested blocks included.
int64_t fragment_ops_in(torch::jit::Block* block) {
  int64_t n = 0;
  for (auto* node : block->nodes()) {
    for (auto* inner : node->blocks()) n += fragment_ops_in(inner);
    if (ir::is_fragment_op(node->kind())) ++n;  // gather/intervene/split (not the model's own frag:: ops)
  }
  return n;
}

TEST(Specialization, FollowsInterventionsChangedBetweenForwards) {
  FRAG_REQUIRE_GLOO();
  const std::string location = "model.layers.0.mlp.down_proj.input";
  expect_no_errors(on_ranks("llama_tp2", [&](int, ShardedModel& model) {
    EXPECT_EQ(fragment_ops_in(model.forward_graph()->block()), 0) << "nothing registered: no fragment op runs";
    model.set_specialize(false);
    const int64_t full = fragment_ops_in(model.forward_graph()->block());
    EXPECT_GT(full, 40) << "the full rewrite";
    model.set_specialize(true);
    const auto plain = model.forward(token_ids());
    EXPECT_EQ(model.interventions().collectives_at(location), 0);
    model.save(location, "x");
    EXPECT_EQ(fragment_ops_in(model.forward_graph()->block()), 3) << "one triple, at the saved location";
    model.forward(token_ids());
    EXPECT_EQ(model.saved().count("x"), 1u) << "a save registered after a forward takes effect";
    EXPECT_EQ(model.interventions().collectives_at(location), 1);
    model.clear();
    EXPECT_EQ(fragment_ops_in(model.forward_graph()->block()), 0);
    EXPECT_TRUE(torch::equal(model.forward(token_ids()), plain));
    EXPECT_EQ(model.saved().at("x").size(), 1u) << "a cleared save does not run";
    EXPECT_EQ(model.interventions().collectives_at(location), 1);
    // Hooks added to the runtime itself, not through on(), are followed too.
    int calls = 0;
    model.interventions().add(location, [&calls](torch::Tensor& whole, const VisitInfo&) -> std::optional<torch::Tensor> {
      ++calls;
      return torch::zeros_like(whole);
    });
    const auto zeroed = model.forward(token_ids());
    EXPECT_EQ(calls, 1);
    EXPECT_EQ(model.interventions().collectives_at(location), 2);
    EXPECT_FALSE(torch::equal(zeroed, plain)) << "the replacement reached the model";
  }));
}

TEST(Specialization, MoreSetsOfLocationsThanTheCacheHolds) {
  FRAG_REQUIRE_GLOO();
  expect_no_errors(on_ranks("llama_tp2", [&](int, ShardedModel& model) {
    const auto locations = model.table().fragmented_locations();
    ASSERT_GT(locations.size(), 8u) << "the cache holds 8 sets";
    // The reference: every location saved at once by the full rewrite.
    model.set_specialize(false);
    for (const auto& location : locations) model.save(location, location);
    model.forward(token_ids());
    const SavedTensors reference = model.saved();
    model.clear();
    model.clear_saved();
    model.set_specialize(true);
    // One location at a time, then the first again (evicted by then).
    auto order = locations;
    order.push_back(locations.front());
    for (const auto& location : order) {
      model.clear();
      model.clear_saved();
      model.save(location, "x");
      model.forward(token_ids());
      ASSERT_EQ(model.saved().count("x"), 1u) << location;
      EXPECT_TRUE(torch::equal(model.saved().at("x").at(0), reference.at(location).at(0))) << location;
      EXPECT_EQ(fragment_ops_in(model.forward_graph()->block()), 3) << location;
    }
  }));
}

TEST(TokenIds, IdsAlreadyOnTheDeviceAreTheSameTensorOthersAreMovedOrRefused) {
  // What every forward does to its ids (ShardedModel::forward): on the CPU only the dtype part can act,
  // and int64 ids there must come back as the very tensor (no copy per forward).
  const auto ids = token_ids();
  EXPECT_TRUE(token_ids_on(ids, torch::kCPU, "m").is_same(ids));
  const auto widened = token_ids_on(ids.to(torch::kInt), torch::kCPU, "m");
  EXPECT_EQ(widened.scalar_type(), torch::kLong);
  EXPECT_TRUE(torch::equal(widened, ids));
  try {
    token_ids_on(ids.to(torch::kFloat), torch::kCPU, "rank0.pt");
    ADD_FAILURE() << "floating-point ids were taken";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rank0.pt: token ids must be integers, got Float");
  }
}

TEST(TokenIds, AForwardTakesInt32Ids) {
  auto model = ShardedModel::load(RankContext::single_rank(), model_files("llama_tp1")[0]);
  EXPECT_EQ(model.device(), torch::Device(torch::kCPU));
  const auto logits = model.forward(token_ids());
  EXPECT_TRUE(torch::equal(model.forward(token_ids().to(torch::kInt)), logits));
}

TEST(Plans, ARepeatedPlanStaysRegisteredAndAChangedOneReplacesIt) {
  // What a trace does before every forward (python/fragments/_C.cpp): set_plan.
  FRAG_REQUIRE_GLOO();
  const std::string folder = temporary_folder();
  write_safetensors(folder + "/v.safetensors", {{"a", torch::full({64}, 0.5)}, {"b", torch::full({64}, -0.5)}});
  auto plan = [&](const std::string& at, const std::string& value) {
    return Plan::from_json(nlohmann::json::array({{{"at", at}, {"do", "add"}, {"value", "v.safetensors:" + value}},
                                                  {{"at", "model.layers.1.output"}, {"do", "save"}, {"as", "x"}}}),
                           "plan.json", folder);
  };
  const std::string layer0 = "model.layers.0.output";
  expect_no_errors(on_ranks("llama_tp2", [&](int, ShardedModel& model) {
    const auto plain = model.forward(token_ids());
    model.set_plan(plan(layer0, "a"));
    const int64_t registered = model.interventions().changes();
    const auto a = model.forward(token_ids());
    EXPECT_FALSE(torch::equal(a, plain));
    model.clear_saved();
    model.set_plan(plan(layer0, "a"));  // made anew: the same steps, the same bytes
    EXPECT_EQ(model.interventions().changes(), registered) << "a repeated plan is not registered again";
    EXPECT_TRUE(torch::equal(model.forward(token_ids()), a));
    ASSERT_EQ(model.saved().count("x"), 1u);
    EXPECT_EQ(model.saved().at("x").size(), 1u) << "its save ran once, as registered once";
    model.set_plan(plan(layer0, "b"));
    EXPECT_NE(model.interventions().changes(), registered) << "other bytes under the same name: another plan";
    EXPECT_FALSE(torch::equal(model.forward(token_ids()), a));
    model.set_plan(plan(layer0, "a"));
    EXPECT_TRUE(torch::equal(model.forward(token_ids()), a)) << "b's edit is gone";
    // Something registered beside it by another call: the same plan set again replaces everything.
    model.save(layer0, "beside");
    model.set_plan(plan(layer0, "a"));
    model.clear_saved();
    EXPECT_TRUE(torch::equal(model.forward(token_ids()), a));
    EXPECT_EQ(model.saved().count("beside"), 0u);
    // A bad plan fails whole and leaves nothing registered.
    EXPECT_THROW(model.set_plan(plan("model.layers.0.nonesuch", "a")), Error);
    EXPECT_TRUE(torch::equal(model.forward(token_ids()), plain));
  }));
}

TEST(Safety, ARankDivergentPlanIsRefusedNotHung) {
  FRAG_REQUIRE_GLOO();
  auto start = std::chrono::steady_clock::now();
  auto errors = on_ranks("llama_tp2", [&](int rank, ShardedModel& model) {
    model.save("model.layers.0.output", "x");
    if (rank == 1) model.save("model.layers.0.self_attn.qkv_proj.output", "only_on_rank_1");
    model.forward(token_ids());
  });
  for (const auto& e : errors) EXPECT_NE(e.find("ranks hold different interventions"), std::string::npos) << e;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 60s);
}

TEST(Safety, ValuesOfTheSamePathButOtherBytesAreADivergentPlan) {
  // The ranks compare a step's value by its bytes: each rank reads
  // "v.safetensors" from its own folder, and one rank's holds other numbers.
  FRAG_REQUIRE_GLOO();
  std::vector<std::string> folders = {temporary_folder(), temporary_folder()};
  write_safetensors(folders[0] + "/v.safetensors", {{"v", torch::ones({64})}});
  write_safetensors(folders[1] + "/v.safetensors", {{"v", torch::full({64}, 2.0)}});
  auto errors = on_ranks("llama_tp2", [&](int rank, ShardedModel& model) {
    model.apply(Plan::from_json(
        nlohmann::json::array({{{"at", "model.layers.0.output"}, {"do", "add"}, {"value", "v.safetensors:v"}}}),
        "plan.json", folders[rank]));
    model.forward(token_ids());
  });
  for (const auto& e : errors) EXPECT_NE(e.find("ranks hold different interventions"), std::string::npos) << e;
}

TEST(Safety, AVisitThatNeverHappensIsReported) {
  FRAG_REQUIRE_GLOO();
  expect_no_errors(on_ranks("llama_tp2", [&](int, ShardedModel& model) {
    model.save("model.layers.0.output", "first", /*visit=*/0);
    model.save("model.layers.1.output", "sixth", /*visit=*/5);
    model.forward(token_ids());
    const auto unreached = model.unreached_visits();
    ASSERT_EQ(unreached.size(), 1u);
    EXPECT_EQ(unreached[0], "visit 5 at model.layers.1.output was never reached: the last forward visited it 1 time");
    EXPECT_EQ(model.saved().count("sixth"), 0u);
    model.clear();
    EXPECT_TRUE(model.unreached_visits().empty());
  }));
}

/// Applies a one-step plan on a tp=2 model and expects `message` before any forward.
void expect_plan_error(const nlohmann::json& step, const std::string& message) {
  auto folder = temporary_folder();
  write_safetensors(folder + "/v.safetensors", {{"wide", torch::zeros({65})}, {"ints", torch::zeros({64}, torch::kLong)}});
  auto errors = on_ranks("llama_tp2", [&](int, ShardedModel& model) {
    model.apply(Plan::from_json(nlohmann::json::array({step}), "plan.json", folder));
    ADD_FAILURE() << "apply should have thrown";
  });
  for (const auto& e : errors) EXPECT_NE(e.find(message), std::string::npos) << e;
}

TEST(Safety, BadPlansFailBeforeAnythingRuns) {
  FRAG_REQUIRE_GLOO();
  expect_plan_error({{"at", "model.layers.9.output"}, {"do", "save"}, {"as", "x"}}, "unknown location 'model.layers.9.output' (did you mean model.layers.");
  // Issue 16: the suggestion was gate_up_proj's output (another value); act_fn's output is down_proj's input.
  expect_plan_error({{"at", "model.layers.0.mlp.act_fn.output"}, {"do", "zero"}},
                    "model.layers.0.mlp.act_fn.output is rank-local (derived from model.layers.0.mlp.gate_up_proj.output): "
                    "no rank holds its whole value here; the same value is whole at "
                    "model.layers.0.mlp.down_proj.input: intervene there instead");
  expect_plan_error({{"at", "model.layers.0.mlp.act_fn.input"}, {"do", "save"}, {"as", "x"}},
                    "the same value is whole at model.layers.0.mlp.gate_up_proj.output: intervene there instead");
  expect_plan_error({{"at", "model.layers.0.mlp.gate_up_proj.output"}, {"do", "zero"}, {"index", "...,250:300"}},
                    "out of range on the last dim, whose whole width is 256");
  expect_plan_error({{"at", "model.layers.0.self_attn.o_proj.input"}, {"do", "add"}, {"value", "v.safetensors:wide"}},
                    "has last dim 65, but the selected whole has width 64");
  expect_plan_error({{"at", "model.layers.0.output"}, {"do", "add"}, {"value", "v.safetensors:ints"}},
                    "is Long, but the model computes in Float");
  expect_plan_error({{"at", "model.layers.0.output"}, {"do", "explode"}}, "unknown action \"explode\"");
  expect_plan_error({{"at", "model.layers.0.output"}, {"do", "add"}, {"value", "v.safetensors:nope"}}, "has no tensor \"nope\"");
}

TEST(Safety, StepsAtWholeLocationsAreCheckedBeforeTheForwardRuns) {
  FRAG_REQUIRE_GLOO();
  // Whole locations have no width in the rule table: the ranks learn it from a
  // single-token forward with read-only hooks and refuse, all alike, before the
  // forward runs (the save at an earlier location never sees a value).
  auto folder = temporary_folder();
  write_safetensors(folder + "/v.safetensors", {{"wide", torch::zeros({65})}, {"fits", torch::ones({64})}});
  const nlohmann::json first_save = {{"at", "model.embed_tokens.output"}, {"do", "save"}, {"as", "first"}};
  const std::vector<std::pair<nlohmann::json, std::string>> cases = {
      {{{"at", "model.layers.0.output"}, {"do", "add"}, {"value", "v.safetensors:wide"}},
       "plan.json: intervention 1 (add at model.layers.0.output): value v.safetensors:wide has last dim 65, but the "
       "selected whole has width 64"},
      {{{"at", "model.layers.1.output"}, {"do", "zero"}, {"index", "...,60:70"}},
       "out of range on the last dim, whose whole width is 64"},
      {{{"at", "model.layers.0.output"}, {"do", "call"}, {"as", "x"}, {"modules", {"model.layers.1.mlp.down_proj"}}},
       "model.layers.1.mlp.down_proj takes a whole input of width 128, but model.layers.0.output is 64 wide"},
  };
  for (const auto& bad_case : cases) {
    // Named references, not structured bindings: C++17 lambdas cannot capture bindings (clang refuses).
    const auto& bad_step = bad_case.first;
    const auto& message = bad_case.second;
    SCOPED_TRACE(bad_step.dump());
    auto errors = on_ranks("llama_tp2", [&](int, ShardedModel& model) {
      model.apply(Plan::from_json(nlohmann::json::array({first_save, bad_step}), "plan.json", folder));
      try {
        model.forward(token_ids());
      } catch (const Error& first) {
        EXPECT_TRUE(model.saved().empty()) << "the forward ran before the check";
        try {
          model.forward(token_ids());
          ADD_FAILURE() << "a retry ran the plan unchecked";
        } catch (const Error& again) {
          EXPECT_EQ(std::string(again.what()), first.what()) << "a retry must fail alike";
        }
        EXPECT_TRUE(model.saved().empty());
        throw;
      }
    });
    for (const auto& e : errors) {
      EXPECT_NE(e.find(message), std::string::npos) << e;
      EXPECT_EQ(e.find("Traceback"), std::string::npos) << "one clean line: " << e;
    }
  }
  // A value that fits runs, and the width learned once is not probed again.
  expect_no_errors(on_ranks("llama_tp2", [&](int, ShardedModel& model) {
    const nlohmann::json add = {{"at", "model.layers.0.output"}, {"do", "add"}, {"value", "v.safetensors:fits"}};
    model.apply(Plan::from_json(nlohmann::json::array({first_save, add}), "plan.json", folder));
    auto& group = model.context().group("tp");
    const int64_t before = group.collective_count();
    model.forward(token_ids());
    const int64_t with_probe = group.collective_count() - before;
    EXPECT_EQ(model.saved().at("first").size(), 1u);
    model.apply(Plan::from_json(nlohmann::json::array({add}), "plan.json", folder));  // checked at once now
    const int64_t again = group.collective_count();
    model.forward(token_ids());
    EXPECT_EQ(with_probe, 2 * (group.collective_count() - again)) << "one probe forward, then none";
  }));
}

TEST(Generation, SteeringChangesTheGenerationAsAtTp1) {
  FRAG_REQUIRE_GLOO();
  auto folder = temporary_folder();
  torch::manual_seed(5);
  write_safetensors(folder + "/steer.safetensors", {{"v", torch::randn({64}) * 4}});
  nlohmann::json plan = nlohmann::json::array(
      {{{"at", "model.layers.1.output"}, {"do", "add"}, {"value", "steer.safetensors:v"}},
       {{"at", "model.layers.0.self_attn.qkv_proj.output"}, {"do", "save"}, {"as", "qkv"}}});
  auto generate = [&](const std::string& name, const nlohmann::json& p) {
    torch::Tensor tokens;
    SavedTensors saved;
    expect_no_errors(on_ranks(name, [&](int rank, ShardedModel& model) {
      if (!p.is_null()) model.apply(Plan::from_json(p, "plan", folder));
      auto t = model.generate(token_ids(), 4);
      if (rank == 0) {
        tokens = t;
        saved = model.saved();
      }
    }));
    return std::make_pair(tokens, saved);
  };
  auto [plain, unused] = generate("llama_tp2", nullptr);
  auto [steered1, saved1] = generate("llama_tp1", plan);
  auto [steered2, saved2] = generate("llama_tp2", plan);
  ASSERT_EQ(steered2.sizes(), (std::vector<int64_t>{2, 12}));
  EXPECT_TRUE(torch::equal(steered1, steered2));
  EXPECT_FALSE(torch::equal(plain, steered2)) << "the steering vector must change the generation";
  for (int s = 0; s < 4; ++s) {
    auto key = "step" + std::to_string(s) + ".qkv";
    ASSERT_EQ(saved2.count(key), 1u) << key;
    EXPECT_EQ(saved2.at(key)[0].size(1), s == 0 ? 8 : 1);  // the prefill, then one token a step (KV cache)
    EXPECT_LT((saved2.at(key)[0] - saved1.at(key)[0]).abs().max().item<double>(), kValueTolerance);
  }
}

}  // namespace
}  // namespace frag::program
