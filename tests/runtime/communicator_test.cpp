//===- tests/runtime/communicator_test.cpp - Collectives and rendezvous --===//
//
// Ranks run as threads of this process, each with its own RankContext over a
// real TCP store and real Gloo, so the tests see the same code paths as
// separate processes do.
//
//===----------------------------------------------------------------------===//
#include "ir/error.h"
#include "runtime/rank_context.h"
#include "tests/support/test_support.h"
#include "cli/launcher.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <memory>
#include <thread>

namespace frag::runtime {
namespace {

using namespace std::chrono_literals;

using testing::run_ranks;
using Context = std::shared_ptr<RankContext>;

TEST(SingleRank, CollectivesAreCopies) {
  auto context = RankContext::single_rank();
  auto x = torch::randn({3, 4});
  auto reduced = context->group("tp").all_reduce(x);
  EXPECT_TRUE(torch::equal(reduced, x));
  EXPECT_NE(reduced.data_ptr(), x.data_ptr());
  auto pieces = context->group("tp").all_gather(x);
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_TRUE(torch::equal(pieces[0], x));
  EXPECT_EQ(context->group("tp").collective_count(), 2);
  auto stacked = context->group("tp").all_gather_stacked(x);
  EXPECT_TRUE(torch::equal(stacked, x.unsqueeze(0)));
  EXPECT_NE(stacked.data_ptr(), x.data_ptr());
}

TEST(SingleRank, UnknownGroupIsAnError) {
  auto context = RankContext::single_rank();
  try {
    context->group("dp");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'dp'"), std::string::npos);
  }
}

class GlooRanks : public ::testing::TestWithParam<int> {};

TEST_P(GlooRanks, AllReduceSumsAndAllGatherKeepsRankOrder) {
  FRAG_REQUIRE_GLOO();
  const int world = GetParam();
  auto errors = run_ranks(world, 20s, [world](int rank, const Context& context) {
    auto x = torch::full({2, 3}, static_cast<float>(rank + 1));
    auto sum = context->group("tp").all_reduce(x);
    EXPECT_TRUE(torch::equal(sum, torch::full({2, 3}, world * (world + 1) / 2.0f)));
    EXPECT_TRUE(torch::equal(x, torch::full({2, 3}, static_cast<float>(rank + 1))))
        << "all_reduce must be out of place";
    auto pieces = context->group("tp").all_gather(x);
    ASSERT_EQ(static_cast<int>(pieces.size()), world);
    for (int r = 0; r < world; ++r)
      EXPECT_TRUE(torch::equal(pieces[r], torch::full({2, 3}, static_cast<float>(r + 1))));
    EXPECT_EQ(context->group("tp").collective_count(), 2);
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST_P(GlooRanks, BFloat16GathersBitExactAndSumsOnceRounded) {
  FRAG_REQUIRE_GLOO();
  const int world = GetParam();
  auto errors = run_ranks(world, 20s, [world](int rank, const Context& context) {
    // Deterministic (the ranks are threads: no shared random generator), with
    // full bf16 mantissas; sums of a few such values are exact in float32.
    auto of_rank = [](int r) {
      return ((torch::arange(15, torch::kFloat).reshape({3, 5}) * 0.3711 + r * 1.1317).sin() * 10)
          .to(torch::kBFloat16);
    };
    auto x = of_rank(rank);
    auto pieces = context->group("tp").all_gather(x);
    ASSERT_EQ(static_cast<int>(pieces.size()), world);
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(pieces[r].scalar_type(), torch::kBFloat16);
      EXPECT_TRUE(torch::equal(pieces[r], of_rank(r))) << "piece of rank " << r;
    }
    auto sum = context->group("tp").all_reduce(x);
    EXPECT_EQ(sum.scalar_type(), torch::kBFloat16);
    auto expected = torch::zeros({3, 5});
    for (int r = 0; r < world; ++r) expected += of_rank(r).to(torch::kFloat);
    EXPECT_TRUE(torch::equal(sum, expected.to(torch::kBFloat16)));
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST_P(GlooRanks, StackedGatherIsOneBufferInRankOrderBitExact) {
  FRAG_REQUIRE_GLOO();
  const int world = GetParam();
  auto errors = run_ranks(world, 20s, [world](int rank, const Context& context) {
    for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
      auto of_rank = [dtype](int r) { return ((torch::arange(6, torch::kFloat).reshape({2, 3}) + r) * 0.77).to(dtype); };
      auto stacked = context->group("tp").all_gather_stacked(of_rank(rank));
      ASSERT_EQ(stacked.sizes(), (std::vector<int64_t>{world, 2, 3}));
      EXPECT_EQ(stacked.scalar_type(), dtype);
      EXPECT_TRUE(stacked.is_contiguous());
      for (int r = 0; r < world; ++r) EXPECT_TRUE(torch::equal(stacked[r], of_rank(r))) << "rank " << r;
    }
    context->synchronize();  // Gloo: nothing pending, a no-op
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST_P(GlooRanks, ModelOpsRouteToTheCurrentContext) {
  FRAG_REQUIRE_GLOO();
  const int world = GetParam();
  auto errors = run_ranks(world, 20s, [world](int rank, const Context& context) {
    ScopedRankContext scope(context);  // the ops find it as the current context
    auto all_reduce = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("frag::all_reduce", "")
                          .typed<at::Tensor(const at::Tensor&, std::string)>();
    auto all_gather = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("frag::all_gather", "")
                          .typed<at::Tensor(const at::Tensor&, int64_t, std::string)>();
    auto x = torch::arange(4, torch::kFloat).reshape({2, 2}) + 10 * rank;
    auto gathered = all_gather.call(x, -1, "tp");
    ASSERT_EQ(gathered.sizes(), (std::vector<int64_t>{2, 2 * world}));
    for (int r = 0; r < world; ++r)
      EXPECT_TRUE(torch::equal(gathered.narrow(-1, 2 * r, 2),
                               torch::arange(4, torch::kFloat).reshape({2, 2}) + 10 * r));
    auto reduced = all_reduce.call(x, "tp");
    EXPECT_TRUE(torch::allclose(reduced, torch::arange(4, torch::kFloat).reshape({2, 2}) * world +
                                             10.0 * world * (world - 1) / 2));
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Worlds, GlooRanks, ::testing::Values(2, 3, 4));

TEST(Gloo, APeerThatNeverJoinsTheCollectiveTimesOut) {
  FRAG_REQUIRE_GLOO();
  auto start = std::chrono::steady_clock::now();
  // The timeout also bounds connecting, which a loaded machine slows: 5 s, and
  // the idle peer outlives it.
  auto errors = run_ranks(2, 5s, [](int rank, const Context& context) {
    if (rank == 0) context->group("tp").all_reduce(torch::ones({4}));
    else std::this_thread::sleep_for(10s);  // alive, but never joins
  });
  auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_NE(errors[0].find("all_reduce failed on rank 0 of 2"), std::string::npos) << errors[0];
  EXPECT_EQ(errors[1], "");
  EXPECT_LT(elapsed, 30s);
}

TEST(Rendezvous, AnUnreachableStoreFailsWithinTheTimeout) {
  RendezvousOptions options;
  options.rank = 1;
  options.world_size = 2;
  options.master_port = frag::cli::find_free_port();  // nobody serves it
  options.timeout = 1500ms;
  auto start = std::chrono::steady_clock::now();
  try {
    RankContext::connect(options);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rendezvous at 127.0.0.1:"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
}

TEST(Rendezvous, AgreeFailsOnEveryRankWhenOneRankFails) {
  FRAG_REQUIRE_GLOO();
  auto errors = run_ranks(3, 20s, [](int rank, const Context& context) {
    context->agree("check", rank == 1 ? "bad file" : "");
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(errors[r], "rank 1: bad file") << "rank " << r;
}

TEST(Rendezvous, AgreeNamesRanksThatFailedAlikeOnce) {
  FRAG_REQUIRE_GLOO();
  auto same = run_ranks(3, 20s, [](int, const Context& context) { context->agree("check", "bad plan"); });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(same[r], "every rank: bad plan") << "rank " << r;
  auto mixed = run_ranks(3, 20s, [](int rank, const Context& context) {
    context->agree("check", rank == 1 ? "bad file" : "bad plan");
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(mixed[r], "ranks 0, 2: bad plan; rank 1: bad file") << "rank " << r;
}

TEST(Rendezvous, ExchangeReturnsValuesInRankOrder) {
  FRAG_REQUIRE_GLOO();
  auto errors = run_ranks(3, 20s, [](int rank, const Context& context) {
    auto values = context->exchange("names", "r" + std::to_string(rank));
    EXPECT_EQ(values, (std::vector<std::string>{"r0", "r1", "r2"}));
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(RendezvousOptions, ReadsTorchrunVariables) {
  setenv("RANK", "2", 1);
  setenv("WORLD_SIZE", "4", 1);
  setenv("MASTER_ADDR", "10.1.2.3", 1);
  setenv("MASTER_PORT", "1234", 1);
  unsetenv("LOCAL_RANK");
  auto options = RendezvousOptions::from_env();
  EXPECT_EQ(options.rank, 2);
  EXPECT_EQ(options.world_size, 4);
  EXPECT_EQ(options.local_rank, 2);
  EXPECT_EQ(options.master_addr, "10.1.2.3");
  EXPECT_EQ(options.master_port, 1234);
  setenv("RANK", "4", 1);
  EXPECT_THROW(RendezvousOptions::from_env(), Error);
  setenv("RANK", "x", 1);
  EXPECT_THROW(RendezvousOptions::from_env(), Error);
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) unsetenv(name);
}

}  // namespace
}  // namespace frag::runtime
