//===- tests/runtime/ad_hoc_call_test.cpp - Parallel layers on whole tensors ===//
//
// A layer called ad hoc on a whole input at tp=N must give what the tp=1
// layer gives on the same input: the call wrapper cuts the input by the
// layer's input rule and reassembles the output by its output rule.
//
//===----------------------------------------------------------------------===//
#include "ir/error.h"
#include "program/sharded_model.h"
#include "tests/support/model_ranks.h"
#include "tests/support/test_support.h"

#include <gtest/gtest.h>

#include <functional>

namespace frag::runtime {
namespace {

using namespace std::chrono_literals;
using program::ShardedModel;
using program::SavedTensors;
using testing::on_ranks;

constexpr double kTolerance = 2e-5;

torch::Tensor token_ids() {
  return torch::tensor({1, 2, 3, 4, 5, 6, 7, 8, 999, 17, 42, 63, 64, 65, 500, 0}, torch::kLong).reshape({2, 8});
}

void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

/// Rank 0's result of `body`, which every rank runs.
torch::Tensor on_rank0(const std::string& export_name, const std::function<torch::Tensor(ShardedModel&)>& body) {
  torch::Tensor result;
  expect_no_errors(on_ranks(export_name, [&](int rank, ShardedModel& model) {
    auto value = body(model);
    if (rank == 0) result = value;
  }));
  return result;
}

struct Pair {
  const char* whole;
  const char* sharded;
};

class LogitLens : public ::testing::TestWithParam<Pair> {};

TEST_P(LogitLens, EveryLayersLensEqualsTheTp1Lens) {
  FRAG_REQUIRE_GLOO();
  nlohmann::json plan = nlohmann::json::array();
  for (int layer = 0; layer < 2; ++layer)
    plan.push_back({{"at", "model.layers." + std::to_string(layer) + ".output"}, {"do", "call"},
                    {"modules", {"model.norm", "lm_head"}}, {"as", "lens" + std::to_string(layer)}});
  auto run = [&](const std::string& name) {
    SavedTensors saved;
    torch::Tensor logits;
    expect_no_errors(on_ranks(name, [&](int rank, ShardedModel& model) {
      model.apply(Plan::from_json(plan, "lens plan", ""));
      auto l = model.forward(token_ids());
      if (rank == 0) {
        saved = model.saved();
        logits = l;
      }
    }));
    return std::make_pair(saved, logits);
  };
  auto [expected, unused] = run(GetParam().whole);
  auto [actual, logits] = run(GetParam().sharded);
  for (const char* name : {"lens0", "lens1"}) {
    ASSERT_EQ(actual.at(name)[0].sizes(), (std::vector<int64_t>{2, 8, 1000})) << "padding dropped";
    EXPECT_LT((actual.at(name)[0] - expected.at(name)[0]).abs().max().item<double>(), kTolerance) << name;
  }
  // The lens at the last layer is the model's own head.
  EXPECT_LT((actual.at("lens1")[0] - logits).abs().max().item<double>(), kTolerance);
}

INSTANTIATE_TEST_SUITE_P(ReferenceModels, LogitLens,
                         ::testing::Values(Pair{"llama_tp1", "llama_tp2"}, Pair{"llama_kv2_tp1", "llama_kv2_tp4"},
                                           Pair{"moe_tp1", "moe_tp2"}, Pair{"moe_tp1", "moe_tp4"},
                                           Pair{"moe_tp1", "moe_ep_tp2"}),
                         [](const auto& info) { return std::string(info.param.sharded); });

/// A module called ad hoc on the same whole inputs at tp=1 and tp=N.
struct LayerCall {
  const char* whole;
  const char* sharded;
  const char* path;
  int64_t width;           ///< whole input width
  bool token_input = false;  ///< ids instead of floats
  bool with_router = false;  ///< a FusedMoE: second input router_logits [T, 4]
};

class EachLayerKind : public ::testing::TestWithParam<LayerCall> {};

TEST_P(EachLayerKind, EqualsTheTp1Layer) {
  FRAG_REQUIRE_GLOO();
  const auto& p = GetParam();
  torch::manual_seed(11);
  std::vector<torch::Tensor> inputs;
  if (p.token_input) {
    inputs.push_back(token_ids());
  } else if (p.with_router) {
    inputs = {torch::randn({16, p.width}), torch::randn({16, 4})};
  } else {
    inputs.push_back(torch::randn({2, 8, p.width}));
  }
  auto call = [&](ShardedModel& model) { return model.call_module(p.path, inputs); };
  auto expected = on_rank0(p.whole, call);
  auto actual = on_rank0(p.sharded, call);
  ASSERT_TRUE(expected.defined() && actual.defined());
  ASSERT_EQ(actual.sizes(), expected.sizes()) << p.path;
  EXPECT_LT((actual - expected).abs().max().item<double>(), kTolerance) << p.path;
}

INSTANTIATE_TEST_SUITE_P(
    Layers, EachLayerKind,
    ::testing::Values(
        LayerCall{"llama_tp1", "llama_tp2", "model.layers.0.self_attn.qkv_proj", 64},     // QKV -> [Q|K|V]
        LayerCall{"llama_kv2_tp1", "llama_kv2_tp4", "model.layers.1.self_attn.qkv_proj", 64},  // kv replicas
        LayerCall{"llama_tp1", "llama_tp4", "model.layers.0.mlp.gate_up_proj", 64},      // merged -> [gate|up]
        LayerCall{"llama_tp1", "llama_tp2", "model.layers.0.mlp.down_proj", 128},        // row, reduce_results
        LayerCall{"llama_tp1", "llama_tp4", "model.layers.1.self_attn.o_proj", 64},      // row, reduce_results
        LayerCall{"moe_tp1", "moe_tp2", "model.layers.0.mlp.shared_expert.down_proj", 64},  // row, partial
        LayerCall{"moe_tp1", "moe_tp2", "model.layers.0.mlp.experts", 64, false, true},  // FusedMoE (TP)
        LayerCall{"moe_tp1", "moe_ep_tp2", "model.layers.1.mlp.experts", 64, false, true},  // FusedMoE (EP)
        LayerCall{"llama_tp1", "llama_tp2", "lm_head", 64},                              // vocab shard out
        LayerCall{"llama_tp1", "llama_tp4", "logits_processor", 1000},                   // vocab shard in
        LayerCall{"llama_tp1", "llama_tp2", "model.embed_tokens", 0, true},              // ids in
        LayerCall{"moe_tp1", "moe_tp4", "model.layers.1.mlp", 64}),                      // a whole block
    [](const auto& info) {
      std::string name = std::string(info.param.sharded) + "_" + info.param.path;
      for (auto& c : name) if (c == '.') c = '_';
      return name;
    });

TEST(AdHocCall, AChainEqualsTheTp1Chain) {
  FRAG_REQUIRE_GLOO();
  torch::manual_seed(2);
  auto hidden = torch::randn({2, 8, 64});
  auto call = [&](ShardedModel& model) { return model.call({"model.norm", "lm_head"}, hidden); };
  auto expected = on_rank0("llama_tp1", call);
  auto actual = on_rank0("llama_tp4", call);
  EXPECT_LT((actual - expected).abs().max().item<double>(), kTolerance);
}

TEST(AdHocCall, ACallWhileVisitingTheSameLocationNeitherDeadlocksNorGathersTwice) {
  FRAG_REQUIRE_GLOO();
  const std::string location = "model.layers.0.mlp.down_proj.input";
  auto start = std::chrono::steady_clock::now();
  expect_no_errors(on_ranks("llama_tp2", [&](int, ShardedModel& model) {
    torch::Tensor called;
    model.on(location, [&](torch::Tensor& whole, const VisitInfo&) -> std::optional<torch::Tensor> {
      called = model.call({"model.layers.0.mlp.down_proj"}, whole);
      return std::nullopt;
    }, std::nullopt, "call", false);
    model.save("model.layers.0.mlp.down_proj.output", "down_out");
    model.forward(token_ids());
    EXPECT_EQ(model.interventions().collectives_at(location), 1);
    EXPECT_EQ(model.interventions().visits_at(location), 1);
    ASSERT_TRUE(called.defined());
    EXPECT_LT((called - model.saved().at("down_out")[0]).abs().max().item<double>(), kTolerance)
        << "the ad-hoc down_proj on the whole input equals the model's own down_proj output";
  }));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 60s);
}

void expect_apply_error(const nlohmann::json& step, const std::string& message) {
  auto errors = on_ranks("llama_tp2", [&](int, ShardedModel& model) {
    model.apply(Plan::from_json(nlohmann::json::array({step}), "plan.json", ""));
    ADD_FAILURE() << "apply should have thrown";
  });
  for (const auto& e : errors) EXPECT_NE(e.find(message), std::string::npos) << e;
}

TEST(AdHocCall, BadCallsFailBeforeAnythingRuns) {
  FRAG_REQUIRE_GLOO();
  expect_apply_error({{"at", "model.layers.0.output"}, {"do", "call"}, {"modules", {"model.nope"}}, {"as", "x"}},
                     "unknown module 'model.nope'");
  expect_apply_error({{"at", "model.layers.0.output"}, {"do", "call"}, {"modules", {"model.layers.1"}}, {"as", "x"}},
                     "model.layers.1 has no call wrapper for 1 tensor(s): its forward takes 4 argument(s), 2 required");
  expect_apply_error({{"at", "model.layers.0.output"}, {"do", "call"}, {"modules", {"model.layers.0.self_attn.attn"}},
                      {"as", "x"}},
                     "model.layers.0.self_attn.attn has no call wrapper");
  expect_apply_error({{"at", "model.layers.0.mlp.gate_up_proj.output"}, {"do", "call"},
                      {"modules", {"model.layers.0.mlp.down_proj"}}, {"as", "x"}},
                     "model.layers.0.mlp.down_proj takes a whole input of width 128, but "
                     "model.layers.0.mlp.gate_up_proj.output is 256 wide");
}

TEST(AdHocCall, AnInputOfTheWrongWidthIsAClearError) {
  FRAG_REQUIRE_GLOO();
  auto errors = on_ranks("llama_tp2", [&](int, ShardedModel& model) {
    model.call({"model.layers.0.mlp.down_proj"}, torch::randn({2, 8, 100}));
  });
  for (const auto& e : errors)
    EXPECT_NE(e.find("model.layers.0.mlp.down_proj: an ad-hoc call needs a whole input of width 128, got shape [2, 8, 100]"),
              std::string::npos)
        << e;
}

}  // namespace
}  // namespace frag::runtime
