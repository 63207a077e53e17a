//===- tests/runtime/whole_value_test.cpp - Fused assembly, bit-identical ===//
//
// The fused assembly (one gathered buffer, one index copy) and the fused cut
// against ir::whole_from_pieces / ir::piece_of_whole, the reference they
// replace: bitwise equal for every all-gather layout, dims and dtypes.
//
//===----------------------------------------------------------------------===//
#include "ir/error.h"
#include "ir/fragment_rule.h"
#include "runtime/whole_value.h"

#include <gtest/gtest.h>

namespace frag::runtime {
namespace {

using ir::FragmentRule;

struct Case {
  std::string name;
  FragmentRule rule;
  std::vector<int64_t> whole_shape;
};

std::vector<Case> cases() {
  std::vector<Case> c;
  c.push_back({"shard dim 0", FragmentRule::shard(0, "tp", 2), {6, 3, 5}});
  c.push_back({"shard dim 1", FragmentRule::shard(1, "tp", 3), {2, 6, 5}});
  c.push_back({"shard dim -1", FragmentRule::shard(-1, "tp", 4), {2, 3, 8}});
  c.push_back({"gate_up", FragmentRule::segments({8, 8}, {"gate", "up"}, "tp", 2), {2, 3, 16}});
  c.push_back({"uneven segments", FragmentRule::segments({4, 8, 12}, {}, "tp", 4), {3, 24}});
  // qkv: 8 q heads of 4, 2 kv heads: tp 2 (kv split) and tp 4 (kv replicated on 2 ranks each).
  c.push_back({"qkv tp2", FragmentRule::qkv(8, 2, 4, 4, "tp", 2), {2, 3, (8 + 2 * 2) * 4}});
  c.push_back({"qkv tp4 kv replicated", FragmentRule::qkv(8, 2, 4, 4, "tp", 4), {2, 3, (8 + 2 * 2) * 4}});
  c.push_back({"qkv tp8 one kv head per 4 ranks", FragmentRule::qkv(8, 2, 4, 6, "tp", 8), {1, 5, 8 * 4 + 2 * 4 + 2 * 6}});
  c.push_back({"padded vocab tp2", FragmentRule::vocab_shard(1000, 1024, "tp", 2), {2, 3, 1000}});
  c.push_back({"padded vocab tp3", FragmentRule::vocab_shard(181, 192, "tp", 3), {1, 2, 181}});
  return c;
}

/// Pieces as the ranks hold them, cut from a random whole by the reference.
std::vector<torch::Tensor> pieces_of(const Case& c, torch::ScalarType dtype) {
  auto whole = torch::randn(c.whole_shape).to(dtype);
  std::vector<torch::Tensor> pieces;
  for (int64_t r = 0; r < c.rule.group_size; ++r) {
    auto piece = ir::piece_of_whole(c.rule, whole, r);
    // Padded vocab rows hold garbage on the ranks; make it visible if it leaks.
    if (c.rule.kind == ir::LayoutKind::kVocabShard) piece = piece.clone();
    pieces.push_back(piece.contiguous());
  }
  return pieces;
}

TEST(FusedAssembly, BitIdenticalToWholeFromPieces) {
  torch::manual_seed(7);
  for (const auto& c : cases())
    for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
      SCOPED_TRACE(c.name + " " + c10::toString(dtype));
      auto pieces = pieces_of(c, dtype);
      auto expected = ir::whole_from_pieces(c.rule, pieces);
      auto fused = whole_from_gathered(c.rule, torch::stack(pieces));
      EXPECT_EQ(fused.sizes(), expected.sizes());
      EXPECT_EQ(fused.scalar_type(), dtype);
      EXPECT_TRUE(fused.is_contiguous());
      EXPECT_TRUE(torch::equal(fused, expected));
      // Twice: the second call takes the cached plan.
      EXPECT_TRUE(torch::equal(whole_from_gathered(c.rule, torch::stack(pieces)), expected));
    }
}

TEST(FusedAssembly, PaddedVocabRowsNeverReachTheWhole) {
  auto rule = FragmentRule::vocab_shard(10, 12, "tp", 2);
  auto gathered = torch::full({2, 3, 6}, 1.0f);
  gathered.index_put_({1, torch::indexing::Slice(), torch::indexing::Slice(4, 6)}, std::nanf(""));
  auto whole = whole_from_gathered(rule, gathered);
  EXPECT_EQ(whole.size(-1), 10);
  EXPECT_FALSE(whole.isnan().any().item<bool>());
}

TEST(FusedAssembly, ShardOnDimZeroIsTheGatheredBufferItself) {
  auto rule = FragmentRule::shard(0, "tp", 2);
  auto gathered = torch::randn({2, 3, 4});
  auto whole = whole_from_gathered(rule, gathered);
  EXPECT_EQ(whole.data_ptr(), gathered.data_ptr()) << "no copy for rank-major blocks";
  EXPECT_EQ(whole.sizes(), (std::vector<int64_t>{6, 4}));
}

TEST(FusedAssembly, WrongGatheredShapesAreErrors) {
  auto rule = FragmentRule::qkv(8, 2, 4, 4, "tp", 2);
  EXPECT_THROW(whole_from_gathered(rule, torch::randn({3, 2, 24})), Error);  // 3 pieces for a group of 2
  EXPECT_THROW(whole_from_gathered(rule, torch::randn({2, 2, 23})), Error);  // not a qkv piece
  EXPECT_THROW(whole_from_gathered(FragmentRule::partial_sum("tp", 2), torch::randn({2, 3})), Error);
}

TEST(FusedCut, BitIdenticalToPieceOfWhole) {
  torch::manual_seed(11);
  for (const auto& c : cases())
    for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
      SCOPED_TRACE(c.name + " " + c10::toString(dtype));
      auto whole = torch::randn(c.whole_shape).to(dtype);
      for (int64_t r = 0; r < c.rule.group_size; ++r) {
        auto expected = ir::piece_of_whole(c.rule, whole, r);
        auto fused = piece_from_whole(c.rule, whole, r);
        EXPECT_EQ(fused.sizes(), expected.sizes());
        EXPECT_TRUE(torch::equal(fused, expected)) << "rank " << r;
        EXPECT_NE(fused.data_ptr(), whole.data_ptr()) << "a fresh tensor";
      }
    }
  // Layouts without a gather keep the reference's behaviour (rank 0 the sum, others -0.0).
  auto sum = torch::randn({2, 3});
  auto rule = FragmentRule::partial_sum("tp", 2);
  EXPECT_TRUE(torch::equal(piece_from_whole(rule, sum, 0), ir::piece_of_whole(rule, sum, 0)));
  EXPECT_TRUE(torch::equal(piece_from_whole(rule, sum, 1), ir::piece_of_whole(rule, sum, 1)));
  EXPECT_THROW(piece_from_whole(FragmentRule::shard(0, "tp", 2), sum, 2), Error);
}

}  // namespace
}  // namespace frag::runtime
