//===- tests/runtime/intervention_runtime_test.cpp - Once-per-visit bookkeeping ===//
//
// The InterventionRuntime driven directly, as the op kernels drive it, on the
// single-rank context (world size 1, rules over one rank): visit counting,
// the lookup when nothing waits, which hooks may keep the whole without a copy,
// and what split hands back.
//
//===----------------------------------------------------------------------===//
#include "runtime/intervention_runtime.h"

#include "ir/fragment_rule.h"
#include "ir/location_table.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace frag::runtime {
namespace {

const std::string kLocation = "model.layers.0.mlp.up_proj.output";

/// The locations of these tests: kLocation fragmented (a shard over one rank),
/// the others whole. Ids follow the table: kLocation is 0.
std::shared_ptr<const ir::LocationTable> test_locations() {
  ir::FragmentTable table;
  ir::LayerEntry layer;
  layer.path = "model.layers.0.mlp.up_proj";
  layer.class_name = layer.kind = "ColumnParallelLinear";
  layer.output = ir::FragmentedSide{ir::FragmentRule::shard(-1, ir::kTpGroup, 1), std::nullopt};
  table.layers.push_back(layer);
  table.whole = {"model.layers.0.output", "a.input", "b.output", "c.input"};
  return std::make_shared<const ir::LocationTable>(table);
}

/// A runtime over test_locations(), as a loaded program makes it.
struct TestRuntime : InterventionRuntime {
  TestRuntime() : InterventionRuntime(test_locations()) {}
  ir::LocationId id(const std::string& name) const { return locations().id_of(name, "test"); }
};

/// One visit of a gather → intervene → split triple, as the bound graph runs it.
torch::Tensor visit(TestRuntime& runtime, const torch::Tensor& piece) {
  const auto id = runtime.id(kLocation);
  auto whole = runtime.gather(piece, id);
  auto left = runtime.intervene(whole, id, /*fragmented=*/true);
  return runtime.split(left, piece, id);
}

/// A hook that records what it was told and keeps the whole as a save does.
struct Keeper {
  std::vector<bool> may_keep;
  std::vector<torch::Tensor> kept;
  Hook hook() {
    return [this](torch::Tensor& whole, const VisitInfo& info) -> std::optional<torch::Tensor> {
      may_keep.push_back(info.may_keep);
      kept.push_back(info.may_keep ? whole : whole.clone());
      return std::nullopt;
    };
  }
};

Hook add_one() {
  return [](torch::Tensor& whole, const VisitInfo&) -> std::optional<torch::Tensor> {
    whole.add_(1);
    return std::nullopt;
  };
}

TEST(InterventionRuntime, NothingWaitingIsALookup) {
  TestRuntime runtime;
  runtime.begin_forward();
  auto piece = torch::randn({2, 4});
  auto out = visit(runtime, piece);
  EXPECT_TRUE(out.is_same(piece)) << "with no hook the triple must hand back the model's own piece";
  EXPECT_EQ(runtime.collectives_at(kLocation), 0);
  EXPECT_EQ(runtime.visits_at(kLocation), 1);
}

TEST(InterventionRuntime, VisitsCountPerForwardCollectivesAccumulate) {
  TestRuntime runtime;
  Keeper keeper;
  runtime.add(kLocation, keeper.hook(), /*visit=*/1, /*edits=*/false);
  auto piece = torch::randn({2, 4});
  for (int forward = 0; forward < 3; ++forward) {
    runtime.begin_forward();
    EXPECT_EQ(runtime.visits_at(kLocation), 0) << "begin_forward must reset the visit count";
    for (int v = 0; v < 3; ++v) visit(runtime, piece);
    EXPECT_EQ(runtime.visits_at(kLocation), 3);
  }
  // Only visit 1 of each forward gathers.
  EXPECT_EQ(runtime.collectives_at(kLocation), 3);
  EXPECT_EQ(keeper.kept.size(), 3u);
}

TEST(InterventionRuntime, ReadOnlyHooksKeepTheGatheredWholeAndTheModelKeepsItsPiece) {
  TestRuntime runtime;
  Keeper first, second;
  runtime.add(kLocation, first.hook(), std::nullopt, /*edits=*/false);
  runtime.add(kLocation, second.hook(), std::nullopt, /*edits=*/false);
  runtime.begin_forward();
  auto piece = torch::randn({2, 4});
  auto out = visit(runtime, piece);
  EXPECT_TRUE(out.is_same(piece)) << "a read-only visit must hand back the original piece";
  ASSERT_EQ(first.may_keep, std::vector<bool>{true});
  ASSERT_EQ(second.may_keep, std::vector<bool>{true});
  // Both saw the one gathered whole, a fresh tensor that is not the model's piece.
  EXPECT_TRUE(first.kept[0].is_same(second.kept[0]));
  EXPECT_NE(first.kept[0].data_ptr(), piece.data_ptr());
  EXPECT_TRUE(torch::equal(first.kept[0], piece));
  EXPECT_EQ(runtime.collectives_at(kLocation), 1);
}

TEST(InterventionRuntime, AHookBeforeAnEditMustCopy) {
  TestRuntime runtime;
  Keeper before, after;
  runtime.add(kLocation, before.hook(), std::nullopt, /*edits=*/false);
  runtime.add(kLocation, add_one(), std::nullopt, /*edits=*/true);
  runtime.add(kLocation, after.hook(), std::nullopt, /*edits=*/false);
  runtime.begin_forward();
  auto piece = torch::randn({2, 4});
  auto out = visit(runtime, piece);
  ASSERT_EQ(before.may_keep, std::vector<bool>{false}) << "an edit follows: keeping would see it change";
  ASSERT_EQ(after.may_keep, std::vector<bool>{false}) << "the whole was edited in place before this hook";
  EXPECT_TRUE(torch::equal(before.kept[0], piece)) << "the value before the edit";
  EXPECT_TRUE(torch::equal(after.kept[0], piece + 1)) << "the value after the edit";
  EXPECT_TRUE(torch::equal(out, piece + 1)) << "the edit is split back into the piece";
  EXPECT_FALSE(out.is_same(piece));
}

TEST(InterventionRuntime, AnEditOnAnotherVisitDoesNotForceACopy) {
  TestRuntime runtime;
  Keeper keeper;
  runtime.add(kLocation, keeper.hook(), std::nullopt, /*edits=*/false);
  runtime.add(kLocation, add_one(), /*visit=*/1, /*edits=*/true);
  runtime.begin_forward();
  auto piece = torch::randn({2, 4});
  EXPECT_TRUE(visit(runtime, piece).is_same(piece));
  EXPECT_TRUE(torch::equal(visit(runtime, piece), piece + 1));
  EXPECT_EQ(keeper.may_keep, (std::vector<bool>{true, false}));
  EXPECT_TRUE(torch::equal(keeper.kept[0], piece));
  EXPECT_TRUE(torch::equal(keeper.kept[1], piece));
}

TEST(InterventionRuntime, AfterAReplacementNothingIsKept) {
  TestRuntime runtime;
  Keeper keeper;
  auto replacement = torch::ones({2, 4});
  runtime.add(
      kLocation, [&](torch::Tensor&, const VisitInfo&) -> std::optional<torch::Tensor> { return replacement; },
      std::nullopt, /*edits=*/true);
  runtime.add(kLocation, keeper.hook(), std::nullopt, /*edits=*/false);
  runtime.begin_forward();
  auto out = visit(runtime, torch::randn({2, 4}));
  ASSERT_EQ(keeper.may_keep, std::vector<bool>{false}) << "the replacement belongs to the user";
  EXPECT_FALSE(keeper.kept[0].is_same(replacement));
  EXPECT_TRUE(torch::equal(out, replacement));
}

TEST(InterventionRuntime, WholeLocationsNeverLendTheModelsValue) {
  TestRuntime runtime;
  Keeper keeper;
  runtime.add("model.layers.0.output", keeper.hook(), std::nullopt, /*edits=*/false);
  runtime.begin_forward();
  auto value = torch::randn({2, 4});
  auto out = runtime.intervene(value, runtime.id("model.layers.0.output"), /*fragmented=*/false);
  EXPECT_TRUE(out.is_same(value));
  ASSERT_EQ(keeper.may_keep, std::vector<bool>{false}) << "the model's own tensor may change later";
  EXPECT_FALSE(keeper.kept[0].is_same(value));
}

TEST(InterventionRuntime, HookedLocationsAndClear) {
  TestRuntime runtime;
  Keeper keeper;
  runtime.add("b.output", keeper.hook());
  runtime.add("a.input", keeper.hook());
  EXPECT_EQ(runtime.hooked_locations(), (std::vector<ir::LocationId>{runtime.id("a.input"), runtime.id("b.output")}));
  EXPECT_TRUE(runtime.has_hooks_at(runtime.id("a.input")));
  EXPECT_FALSE(runtime.has_hooks_at(runtime.id("c.input")));
  runtime.clear();
  EXPECT_TRUE(runtime.hooked_locations().empty());
  EXPECT_FALSE(runtime.has_hooks_at(runtime.id("a.input")));
}

}  // namespace
}  // namespace frag::runtime
