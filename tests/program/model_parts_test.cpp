//===- tests/program/model_parts_test.cpp - ShardedModel's parts on their own ===//
//
// The saved-value store (names by slot and generation step), the rank
// agreement's plan digest (the CUDA graph key: it changes exactly when what is
// registered changes) and the graph cache's lookup by key.
//
//===----------------------------------------------------------------------===//
#include "ir/digest.h"
#include "ir/error.h"
#include "program/captured_forwards.h"
#include "program/rank_agreement.h"
#include "program/saved_values.h"
#include "runtime/rank_context.h"

#include <gtest/gtest.h>

namespace frag::program {
namespace {

TEST(SavedValuesTest, OneSlotPerNameAndTheViewByName) {
  SavedValues saved;
  const auto x = saved.slot("x");
  const auto y = saved.slot("y");
  EXPECT_NE(x, y);
  EXPECT_EQ(saved.slot("x"), x) << "a name registered twice shares its slot (and its list)";
  saved.keep(x, torch::full({1}, 1.0));
  saved.keep(y, torch::full({1}, 2.0));
  saved.keep(x, torch::full({1}, 3.0));
  const SavedTensors& view = saved.view();
  ASSERT_EQ(view.size(), 2u);
  ASSERT_EQ(view.at("x").size(), 2u);
  EXPECT_EQ(view.at("x")[0].item<double>(), 1.0);
  EXPECT_EQ(view.at("x")[1].item<double>(), 3.0) << "in the order kept";
  EXPECT_EQ(view.at("y")[0].item<double>(), 2.0);
  // Values kept after a read join the same lists.
  saved.keep(y, torch::full({1}, 4.0));
  EXPECT_EQ(saved.view().at("y").size(), 2u);
  saved.clear();
  EXPECT_TRUE(saved.view().empty());
  saved.keep(x, torch::full({1}, 5.0));
  EXPECT_EQ(saved.view().at("x").size(), 1u) << "slots survive clear(): hooks registered before keep theirs";
}

TEST(SavedValuesTest, GenerationStepsKeyByStep) {
  SavedValues saved;
  const auto x = saved.slot("x");
  saved.keep(x, torch::full({1}, 0.0));  // a plain forward
  for (int64_t step = 0; step < 3; ++step) {
    saved.set_step(step);
    saved.keep(x, torch::full({1}, 10.0 + step));
    saved.keep(x, torch::full({1}, 20.0 + step));
  }
  saved.set_step(std::nullopt);
  saved.keep(x, torch::full({1}, 1.0));
  const auto& view = saved.view();
  ASSERT_EQ(view.size(), 4u);
  ASSERT_EQ(view.at("x").size(), 2u);
  EXPECT_EQ(view.at("x")[1].item<double>(), 1.0);
  for (int64_t step = 0; step < 3; ++step) {
    const auto& list = view.at("step" + std::to_string(step) + ".x");
    ASSERT_EQ(list.size(), 2u);
    EXPECT_EQ(list[0].item<double>(), 10.0 + step);
    EXPECT_EQ(list[1].item<double>(), 20.0 + step);
  }
}

TEST(SavedValuesTest, AStepNameAndAPlainNameThatSpellItShareTheirList) {
  // As when saves were keyed by the joined text: "step0." + "x" and "step0.x" are one name.
  SavedValues saved;
  const auto x = saved.slot("x");
  const auto spelled = saved.slot("step0.x");
  saved.keep(spelled, torch::full({1}, 1.0));
  saved.set_step(0);
  saved.keep(x, torch::full({1}, 2.0));
  saved.set_step(std::nullopt);
  saved.keep(spelled, torch::full({1}, 3.0));
  const auto& list = saved.view().at("step0.x");
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0].item<double>(), 1.0);
  EXPECT_EQ(list[1].item<double>(), 2.0);
  EXPECT_EQ(list[2].item<double>(), 3.0);
}

TEST(SavedValuesTest, RedirectedKeepsGoToTheBuffers) {
  SavedValues saved;
  const auto x = saved.slot("x");
  std::vector<std::pair<SavedValues::Slot, torch::Tensor>> buffers;
  saved.redirect(&buffers);
  saved.keep(x, torch::full({1}, 1.0));
  saved.redirect(nullptr);
  ASSERT_EQ(buffers.size(), 1u);
  EXPECT_EQ(buffers[0].first, x);
  EXPECT_TRUE(saved.view().empty());
}

TEST(RankAgreementTest, ThePlanDigestChangesExactlyWhenTheRegistrationDoes) {
  RankAgreement agreement;
  const uint64_t empty = agreement.plan_digest();
  EXPECT_EQ(empty, ir::fnv1a(""));
  agreement.add("save:x@a#*");
  const uint64_t one = agreement.plan_digest();
  EXPECT_NE(one, empty);
  EXPECT_EQ(agreement.plan_digest(), one) << "no change, no new digest";
  agreement.add("edit:y@b#0");
  const uint64_t two = agreement.plan_digest();
  EXPECT_NE(two, one);
  EXPECT_EQ(two, ir::fnv1a("save:x@a#*\nedit:y@b#0")) << "the descriptors, one a line";
  agreement.clear();
  EXPECT_EQ(agreement.plan_digest(), empty);
  agreement.add("save:x@a#*");
  agreement.add("edit:y@b#0");
  EXPECT_EQ(agreement.plan_digest(), two) << "the same plan registered again: the same key";
  agreement.clear();
  agreement.add("edit:y@b#0");
  agreement.add("save:x@a#*");
  EXPECT_NE(agreement.plan_digest(), two) << "registration order is part of the plan";
}

TEST(RankAgreementTest, OneRankAgreesAndAChangeAsksAgain) {
  auto context = runtime::RankContext::single_rank();
  RankAgreement agreement;
  EXPECT_FALSE(agreement.agreed());
  agreement.add("save:x@a#*");
  agreement.agree(*context, ir::FragmentTable{});
  EXPECT_TRUE(agreement.agreed());
  agreement.add("save:y@a#*");
  EXPECT_FALSE(agreement.agreed()) << "a registration asks the ranks again";
  agreement.agree(*context, ir::FragmentTable{});
  agreement.clear();
  EXPECT_FALSE(agreement.agreed());
}

TEST(CapturedForwardsTest, EntriesByKeyAndShape) {
  CapturedForwards graphs;
  int weights = 0;
  const auto ids = torch::zeros({1, 4}, torch::kLong);
  CapturedForwards::Key key;
  key.plan = 7;
  auto& first = graphs.entry(key, &weights, ids);
  EXPECT_EQ(&graphs.entry(key, &weights, ids), &first) << "the same key and shape: the same entry";
  CapturedForwards::Key other_plan = key;
  other_plan.plan = 8;
  EXPECT_NE(&graphs.entry(other_plan, &weights, ids), &first);
  EXPECT_NE(&graphs.entry(key, &weights, torch::zeros({1, 5}, torch::kLong)), &first) << "another shape";
  CapturedForwards::Key unspecialized = key;
  unspecialized.specialize = false;
  EXPECT_NE(&graphs.entry(unspecialized, &weights, ids), &first);
  CapturedForwards::Key decode = key;
  decode.decode = true;
  decode.cache = &weights;
  decode.cache_rows = 1;
  decode.cache_len = 16;
  auto& step = graphs.entry(decode, &weights, ids);
  EXPECT_NE(&step, &first) << "a decode step is not a forward of the same plan";
  CapturedForwards::Key longer = decode;
  longer.cache_len = 32;
  EXPECT_NE(&graphs.entry(longer, &weights, ids), &step);

  CapturedForwards fresh;
  fresh.entry(key, &weights, ids).eager_runs = 1;
  EXPECT_EQ(fresh.entry(key, &weights, ids).eager_runs, 1);
  int moved = 0;  // another weights storage drops every entry: the graphs read the weights where they were
  EXPECT_EQ(fresh.entry(key, &moved, ids).eager_runs, 0);
}

}  // namespace
}  // namespace frag::program
