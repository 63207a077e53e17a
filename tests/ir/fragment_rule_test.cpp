//===- tests/ir/fragment_rule_test.cpp - Tests of ir/fragment_rule --------===//
//
// Property tests of the layout arithmetic over many random shapes, group sizes
// and dtypes (fixed seeds): piece_of_whole(whole_from_pieces(pieces)) == pieces
// and whole_from_pieces(piece_of_whole(whole)) == whole, bit for bit, for every
// layout; the traps of fragment-rules.md as explicit cases (plain concat of a
// fused layout, replicated kv heads, vocab padding, partial sums and -0.0); and
// the describe strings, JSON form, validation errors and shape functions.
//
//===----------------------------------------------------------------------===//

#include "ir/fragment_rule.h"
#include "ir/fragment_table.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace frag::ir {
namespace {

using Shape = std::vector<int64_t>;

const std::vector<torch::Dtype> kAllDtypes = {torch::kFloat32, torch::kFloat64, torch::kBFloat16,
                                              torch::kInt32, torch::kInt64};
const std::vector<int64_t> kGroupSizes = {1, 2, 3, 4, 8};
constexpr int kShapesPerCase = 8;

/// Same shape, dtype and bits (so -0.0 != +0.0 here), and torch::equal.
::testing::AssertionResult BitEqual(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.sizes() != b.sizes()) {
    return ::testing::AssertionFailure() << "shapes differ: " << a.sizes() << " vs " << b.sizes();
  }
  if (a.scalar_type() != b.scalar_type()) {
    return ::testing::AssertionFailure()
           << "dtypes differ: " << a.scalar_type() << " vs " << b.scalar_type();
  }
  if (!torch::equal(a, b)) return ::testing::AssertionFailure() << "values differ";
  torch::Dtype bits;
  switch (a.element_size()) {
    case 1:
      bits = torch::kUInt8;
      break;
    case 2:
      bits = torch::kInt16;
      break;
    case 4:
      bits = torch::kInt32;
      break;
    default:
      bits = torch::kInt64;
      break;
  }
  if (!torch::equal(a.contiguous().view(bits), b.contiguous().view(bits))) {
    return ::testing::AssertionFailure() << "values equal but bits differ (signed zeros?)";
  }
  return ::testing::AssertionSuccess();
}

/// Random values; floating tensors get +0.0 and -0.0 sprinkled in.
torch::Tensor RandomTensor(const Shape& shape, torch::Dtype dtype) {
  if (!torch::isFloatingType(dtype)) return torch::randint(-1000, 1000, shape, dtype);
  torch::Tensor t = (torch::randn(shape, torch::kFloat64) * 100).to(dtype);
  t.masked_fill_(torch::rand(shape) < 0.1, -0.0);
  t.masked_fill_(torch::rand(shape) < 0.05, 0.0);
  return t;
}

/// Random leading dims: rank 1..3, sizes 1..4.
Shape LeadDims(std::mt19937& rng) {
  const int rank = std::uniform_int_distribution<int>(1, 3)(rng);
  Shape dims;
  for (int i = 0; i < rank; ++i) dims.push_back(std::uniform_int_distribution<int64_t>(1, 4)(rng));
  return dims;
}

Shape WithLast(Shape lead, int64_t last) {
  lead.push_back(last);
  return lead;
}

/// An int64 tensor holding `values`.
torch::Tensor Longs(const std::vector<int64_t>& values) {
  return torch::tensor(torch::ArrayRef<int64_t>(values), torch::kInt64);
}

int64_t NormDim(int64_t dim, int64_t rank) { return dim < 0 ? dim + rank : dim; }

/// Makes independent random pieces consistent with a real layout: ranks that
/// replicate a value hold the same bits (replicated rules, kv heads), vocab
/// pad entries are zero.
void MakeConsistent(const FragmentRule& rule, std::vector<torch::Tensor>& pieces) {
  const int64_t d = NormDim(rule.dim, pieces[0].dim());
  if (rule.kind == LayoutKind::kReplicated) {
    for (torch::Tensor& piece : pieces) piece.copy_(pieces[0]);
  } else if (rule.kind == LayoutKind::kQkv) {
    const int64_t q_w = rule.heads_per_rank() * rule.head_size;
    const int64_t kv_w = rule.kv_heads_per_rank() * (rule.head_size + rule.v_head_size);
    const int64_t rep = rule.kv_replicas();
    for (int64_t r = 0; r < rule.group_size; ++r) {
      if (r % rep == 0) continue;
      pieces[r].narrow(d, q_w, kv_w).copy_(pieces[r - r % rep].narrow(d, q_w, kv_w));
    }
  } else if (rule.kind == LayoutKind::kVocabShard) {
    const int64_t w = rule.padded_vocab / rule.group_size;
    for (int64_t r = 0; r < rule.group_size; ++r) {
      const int64_t real = std::clamp<int64_t>(rule.org_vocab - r * w, 0, w);
      pieces[r].narrow(d, real, w - real).zero_();
    }
  }
}

/// Both round trips, bit for bit, for one rule, one whole shape and one dtype.
void CheckRoundTrip(const FragmentRule& rule, const Shape& whole_shape_, torch::Dtype dtype) {
  SCOPED_TRACE(::testing::Message()
               << describe(rule) << " over " << rule.group << " = " << rule.group_size << ", whole "
               << torch::IntArrayRef(whole_shape_) << ", " << dtype);
  const Shape ps = piece_shape(rule, whole_shape_);
  EXPECT_EQ(whole_shape(rule, ps), whole_shape_);

  // gather(split(whole)) == whole
  const torch::Tensor whole = RandomTensor(whole_shape_, dtype);
  const torch::Tensor whole_before = whole.clone();
  std::vector<torch::Tensor> pieces;
  for (int64_t r = 0; r < rule.group_size; ++r) {
    torch::Tensor piece = piece_of_whole(rule, whole, r);
    EXPECT_EQ(piece.sizes(), torch::IntArrayRef(ps));
    EXPECT_EQ(piece.scalar_type(), dtype);
    EXPECT_TRUE(piece.is_contiguous());
    EXPECT_FALSE(piece.storage().is_alias_of(whole.storage()));
    pieces.push_back(piece);
  }
  EXPECT_TRUE(BitEqual(whole_from_pieces(rule, pieces), whole));
  EXPECT_TRUE(BitEqual(whole, whole_before));

  if (rule.kind == LayoutKind::kPartialSum) return;  // a sum forgets its terms

  // split(gather(pieces)) == pieces
  std::vector<torch::Tensor> random_pieces;
  for (int64_t r = 0; r < rule.group_size; ++r) random_pieces.push_back(RandomTensor(ps, dtype));
  MakeConsistent(rule, random_pieces);
  const torch::Tensor gathered = whole_from_pieces(rule, random_pieces);
  EXPECT_EQ(gathered.sizes(), torch::IntArrayRef(whole_shape_));
  for (int64_t r = 0; r < rule.group_size; ++r) {
    EXPECT_TRUE(BitEqual(piece_of_whole(rule, gathered, r), random_pieces[r])) << "rank " << r;
  }
}

/// Runs `f` and expects frag::Error whose message holds every needle.
void ExpectInvalid(const std::function<void()>& f, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "expected frag::Error";
  } catch (const frag::Error& e) {
    const std::string message = e.what();
    for (const std::string& needle : needles) {
      EXPECT_NE(message.find(needle), std::string::npos)
          << "message lacks '" << needle << "': " << message;
    }
  }
}

class FragmentRuleTest : public ::testing::Test {
 protected:
  void SetUp() override { torch::manual_seed(1234); }
  std::mt19937 rng_{20240917};
};

// ===== round trips =====

TEST_F(FragmentRuleTest, ShardLastDimRoundTrip) {
  for (int64_t p : kGroupSizes) {
    const FragmentRule rule = FragmentRule::shard(-1, "tp", p);
    for (torch::Dtype dtype : kAllDtypes) {
      for (int i = 0; i < kShapesPerCase; ++i) {
        const int64_t w = std::uniform_int_distribution<int64_t>(1, 6)(rng_);
        CheckRoundTrip(rule, WithLast(LeadDims(rng_), p * w), dtype);
      }
    }
  }
}

TEST_F(FragmentRuleTest, ShardFirstDimRoundTrip) {
  for (int64_t p : kGroupSizes) {
    const FragmentRule rule = FragmentRule::shard(0, "tp", p);
    for (torch::Dtype dtype : kAllDtypes) {
      for (int i = 0; i < kShapesPerCase; ++i) {
        Shape shape = LeadDims(rng_);
        shape.insert(shape.begin(), p * std::uniform_int_distribution<int64_t>(1, 5)(rng_));
        CheckRoundTrip(rule, shape, dtype);
      }
    }
  }
}

TEST_F(FragmentRuleTest, ShardMiddleDimAndZeroSizedLeadingDim) {
  CheckRoundTrip(FragmentRule::shard(1, "tp", 4), {3, 8, 5}, torch::kFloat32);
  CheckRoundTrip(FragmentRule::shard(-2, "tp", 2), {3, 8, 5}, torch::kFloat64);
  CheckRoundTrip(FragmentRule::shard(-1, "tp", 4), {0, 8}, torch::kFloat32);
  CheckRoundTrip(FragmentRule::segments({8, 4}, {}, "tp", 4), {0, 3, 12}, torch::kBFloat16);
}

TEST_F(FragmentRuleTest, SegmentsRoundTripTwoThreeFourUnequalParts) {
  for (size_t parts : {2u, 3u, 4u}) {
    for (int64_t p : kGroupSizes) {
      for (torch::Dtype dtype : kAllDtypes) {
        for (int i = 0; i < kShapesPerCase; ++i) {
          // Unequal sizes: distinct multipliers, shuffled.
          std::vector<int64_t> mult(parts);
          std::iota(mult.begin(), mult.end(), std::uniform_int_distribution<int64_t>(1, 3)(rng_));
          std::shuffle(mult.begin(), mult.end(), rng_);
          std::vector<int64_t> sizes;
          for (int64_t m : mult) sizes.push_back(m * p);
          std::vector<std::string> names;
          if (parts == 2) names = {"gate", "up"};
          const FragmentRule rule = FragmentRule::segments(sizes, names, "tp", p);
          const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
          CheckRoundTrip(rule, WithLast(LeadDims(rng_), total), dtype);
        }
      }
    }
  }
}

TEST_F(FragmentRuleTest, SegmentsOnAnotherDim) {
  FragmentRule rule = FragmentRule::segments({6, 3}, {}, "tp", 3);
  rule.dim = 1;
  validate(rule);
  CheckRoundTrip(rule, {2, 9, 4}, torch::kFloat32);
  rule.dim = -3;
  CheckRoundTrip(rule, {9, 2, 4}, torch::kInt64);
}

TEST_F(FragmentRuleTest, SegmentsIndexMapMatchesReference) {
  // gate = [0, 8), up = [8, 12) at tp = 2: rank 1 holds gate[4:8] | up[2:4].
  const FragmentRule rule = FragmentRule::segments({8, 4}, {"gate", "up"}, "tp", 2);
  const torch::Tensor whole = torch::arange(12, torch::kInt64).view({1, 12});
  EXPECT_TRUE(BitEqual(piece_of_whole(rule, whole, 1),
                       torch::tensor({4, 5, 6, 7, 10, 11}, torch::kInt64).view({1, 6})));
  EXPECT_TRUE(BitEqual(piece_of_whole(rule, whole, 0),
                       torch::tensor({0, 1, 2, 3, 8, 9}, torch::kInt64).view({1, 6})));
}

TEST_F(FragmentRuleTest, SegmentsTrapPlainConcatInterleaves) {
  for (int64_t p : {2, 4}) {
    const FragmentRule rule = FragmentRule::segments({16, 16}, {"gate", "up"}, "tp", p);
    const torch::Tensor whole = torch::arange(3 * 32, torch::kFloat32).view({3, 32});
    std::vector<torch::Tensor> pieces;
    for (int64_t r = 0; r < p; ++r) pieces.push_back(piece_of_whole(rule, whole, r));
    const torch::Tensor plain = torch::cat(pieces, -1);
    EXPECT_EQ(plain.sizes(), whole.sizes());   // right shape ...
    EXPECT_FALSE(torch::equal(plain, whole));  // ... wrong values
    EXPECT_TRUE(BitEqual(whole_from_pieces(rule, pieces), whole));
  }
}

struct QkvCase {
  int64_t heads, kv_heads, head_size, v_head_size, group_size, replicas;
};

TEST_F(FragmentRuleTest, QkvRoundTrip) {
  const std::vector<QkvCase> cases = {
      {8, 2, 4, 4, 4, 2},   // GQA 8q/2kv at tp 4: kv replicas 2
      {8, 2, 6, 4, 4, 2},   // same with v_head_size != head_size
      {8, 1, 4, 4, 8, 8},   // MQA at tp 8
      {16, 1, 2, 3, 8, 8},  // MQA, 2 q heads per rank, v != h
      {32, 8, 2, 2, 2, 1},  // 32q/8kv at tp 2: 4 kv heads per rank
      {32, 8, 2, 5, 2, 1},  // same with v_head_size != head_size
      {4, 4, 3, 3, 1, 1},   // no parallelism
      {12, 4, 2, 2, 4, 1},  // one kv head per rank, no replicas
  };
  for (const QkvCase& c : cases) {
    const FragmentRule rule =
        FragmentRule::qkv(c.heads, c.kv_heads, c.head_size, c.v_head_size, "tp", c.group_size);
    EXPECT_EQ(rule.kv_replicas(), c.replicas);
    EXPECT_EQ(rule.heads_per_rank(), c.heads / c.group_size);
    const int64_t whole_w = (c.heads + c.kv_heads) * c.head_size + c.kv_heads * c.v_head_size;
    for (torch::Dtype dtype : kAllDtypes) {
      for (int i = 0; i < kShapesPerCase; ++i) {
        CheckRoundTrip(rule, WithLast(LeadDims(rng_), whole_w), dtype);
      }
    }
  }
  FragmentRule on_dim0 = FragmentRule::qkv(8, 2, 4, 3, "tp", 4);
  on_dim0.dim = -2;
  CheckRoundTrip(on_dim0, {(8 + 2) * 4 + 2 * 3, 5}, torch::kFloat32);
}

TEST_F(FragmentRuleTest, QkvIndexMapAndReplicaRanksAreNotRead) {
  // 8q/2kv, hs 2, vs 3, tp 4: whole = Q[0,16) | K[16,20) | V[20,26); nh 2, nkv 1, rep 2.
  const FragmentRule rule = FragmentRule::qkv(8, 2, 2, 3, "tp", 4);
  const torch::Tensor whole = torch::arange(26, torch::kInt64).view({1, 26});
  EXPECT_EQ(piece_shape(rule, whole.sizes()), (Shape{1, 4 + 2 + 3}));
  // Rank 1: q heads 2,3 = [4,8); kv head 1 // 2 = 0: K [16,18), V [20,23).
  EXPECT_TRUE(
      BitEqual(piece_of_whole(rule, whole, 1),
               torch::tensor({4, 5, 6, 7, 16, 17, 20, 21, 22}, torch::kInt64).view({1, 9})));
  // Rank 2: q heads 4,5 = [8,12); kv head 1: K [18,20), V [23,26).
  EXPECT_TRUE(
      BitEqual(piece_of_whole(rule, whole, 2),
               torch::tensor({8, 9, 10, 11, 18, 19, 23, 24, 25}, torch::kInt64).view({1, 9})));

  // K/V come only from ranks 0 and 2: poison the replicas' kv on ranks 1 and 3.
  std::vector<torch::Tensor> pieces;
  for (int64_t r = 0; r < 4; ++r) pieces.push_back(piece_of_whole(rule, whole, r));
  pieces[1].narrow(-1, 4, 5).fill_(-999);
  pieces[3].narrow(-1, 4, 5).fill_(-999);
  EXPECT_TRUE(BitEqual(whole_from_pieces(rule, pieces), whole));

  // A plain concat is not even the whole's shape when kv heads are replicated.
  EXPECT_NE(torch::cat(pieces, -1).size(-1), whole.size(-1));
}

TEST_F(FragmentRuleTest, QkvMqaTp8EveryRankHoldsTheOnlyKvHead) {
  const FragmentRule rule = FragmentRule::qkv(8, 1, 2, 2, "tp", 8);
  const torch::Tensor whole = torch::arange(20, torch::kInt64).view({1, 20});
  for (int64_t r = 0; r < 8; ++r) {
    EXPECT_TRUE(BitEqual(piece_of_whole(rule, whole, r),
                         Longs({2 * r, 2 * r + 1, 16, 17, 18, 19}).view({1, 6})));
  }
}

TEST_F(FragmentRuleTest, VocabRoundTrip) {
  for (int64_t p : {1, 2, 4, 8}) {
    for (torch::Dtype dtype : kAllDtypes) {
      for (int i = 0; i < kShapesPerCase; ++i) {
        const int64_t org = std::uniform_int_distribution<int64_t>(1, 300)(rng_);
        const FragmentRule rule =
            FragmentRule::vocab_shard(org, FragmentRule::padded_vocab_size(org, p), "tp", p);
        CheckRoundTrip(rule, WithLast(LeadDims(rng_), org), dtype);
      }
    }
  }
  for (int64_t p : {2, 4}) {
    const FragmentRule rule = FragmentRule::vocab_shard(1000, 1024, "tp", p);
    for (torch::Dtype dtype : kAllDtypes) CheckRoundTrip(rule, {3, 1000}, dtype);
  }
  CheckRoundTrip(FragmentRule::vocab_shard(32001, 32064, "tp", 2), {2, 32001}, torch::kBFloat16);
}

TEST_F(FragmentRuleTest, PaddedVocabSizeFollowsVllm) {
  EXPECT_EQ(FragmentRule::padded_vocab_size(1000, 2), 1024);
  EXPECT_EQ(FragmentRule::padded_vocab_size(1000, 4), 1024);
  EXPECT_EQ(FragmentRule::padded_vocab_size(32001, 2), 32064);
  EXPECT_EQ(FragmentRule::padded_vocab_size(32000, 8), 32000);
  EXPECT_EQ(FragmentRule::padded_vocab_size(151936, 4), 151936);
  EXPECT_EQ(FragmentRule::padded_vocab_size(10, 1, 8), 16);
  ExpectInvalid([] { FragmentRule::padded_vocab_size(1000, 3); }, {"1000", "1024", "tp 3"});
  ExpectInvalid([] { FragmentRule::padded_vocab_size(0, 2); }, {"vocab (0)"});
}

TEST_F(FragmentRuleTest, Vocab32001Tp2Rank1StartsAt16032) {
  const FragmentRule rule =
      FragmentRule::vocab_shard(32001, FragmentRule::padded_vocab_size(32001, 2), "tp", 2);
  EXPECT_EQ(rule.padded_vocab, 32064);
  const torch::Tensor ids = torch::arange(32001, torch::kInt64).view({1, 32001});
  const torch::Tensor rank0 = piece_of_whole(rule, ids, 0);
  const torch::Tensor rank1 = piece_of_whole(rule, ids, 1);
  ASSERT_EQ(rank1.sizes(), torch::IntArrayRef({1, 16032}));
  EXPECT_EQ(rank0[0][16031].item<int64_t>(), 16031);
  EXPECT_EQ(rank1[0][0].item<int64_t>(), 16032);  // not 16001 as an unpadded ceil split
  EXPECT_EQ(rank1[0][32000 - 16032].item<int64_t>(), 32000);
  EXPECT_TRUE(BitEqual(rank1.narrow(-1, 32001 - 16032, 63), torch::zeros({1, 63}, torch::kInt64)));
  EXPECT_TRUE(BitEqual(whole_from_pieces(rule, {rank0, rank1}), ids));
}

TEST_F(FragmentRuleTest, VocabRankEntirelyInPadding) {
  // org 10, padded 64 at tp 8: 8 ids per rank; rank 1 holds ids 8, 9 and pad; ranks 2..7 pad only.
  const FragmentRule rule = FragmentRule::vocab_shard(10, 64, "tp", 8);
  const torch::Tensor whole = torch::arange(1, 11, torch::kFloat32).view({1, 10});
  EXPECT_TRUE(BitEqual(piece_of_whole(rule, whole, 1),
                       torch::tensor({9.f, 10.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}).view({1, 8})));
  for (int64_t r = 2; r < 8; ++r) {
    EXPECT_TRUE(BitEqual(piece_of_whole(rule, whole, r), torch::zeros({1, 8})));
  }
  CheckRoundTrip(rule, {3, 10}, torch::kFloat32);
}

// ===== partial sums =====

torch::Tensor SumInOrder(const std::vector<torch::Tensor>& parts,
                         const std::vector<size_t>& order) {
  torch::Tensor acc = parts[order[0]].clone();
  for (size_t i = 1; i < order.size(); ++i) acc = acc + parts[order[i]];
  return acc;
}

torch::Tensor SumPairwise(const std::vector<torch::Tensor>& parts, size_t lo, size_t hi) {
  if (hi - lo == 1) return parts[lo].clone();
  const size_t mid = (lo + hi) / 2;
  return SumPairwise(parts, lo, mid) + SumPairwise(parts, mid, hi);
}

TEST_F(FragmentRuleTest, PartialSumGatherIsSumInRankOrder) {
  for (int64_t p : kGroupSizes) {
    const FragmentRule rule = FragmentRule::partial_sum("tp", p);
    for (torch::Dtype dtype : kAllDtypes) {
      for (int i = 0; i < kShapesPerCase; ++i) {
        const Shape shape =
            WithLast(LeadDims(rng_), std::uniform_int_distribution<int64_t>(1, 9)(rng_));
        std::vector<torch::Tensor> pieces;
        for (int64_t r = 0; r < p; ++r) pieces.push_back(RandomTensor(shape, dtype));
        std::vector<size_t> order(p);
        std::iota(order.begin(), order.end(), 0);
        EXPECT_TRUE(BitEqual(whole_from_pieces(rule, pieces), SumInOrder(pieces, order)));
      }
    }
  }
}

TEST_F(FragmentRuleTest, PartialSumSplitThenAnySumOrderGivesTheWholeBitExactly) {
  for (int64_t p : kGroupSizes) {
    const FragmentRule rule = FragmentRule::partial_sum("tp", p);
    for (torch::Dtype dtype : {torch::kFloat32, torch::kFloat64, torch::kBFloat16, torch::kFloat16,
                               torch::kInt32, torch::kInt64}) {
      for (int i = 0; i < kShapesPerCase; ++i) {
        const Shape shape =
            WithLast(LeadDims(rng_), std::uniform_int_distribution<int64_t>(1, 9)(rng_));
        torch::Tensor whole = RandomTensor(shape, dtype);
        if (torch::isFloatingType(dtype)) whole.view(-1)[0] = -0.0;  // always hold a -0.0
        std::vector<torch::Tensor> pieces;
        for (int64_t r = 0; r < p; ++r) pieces.push_back(piece_of_whole(rule, whole, r));
        EXPECT_TRUE(BitEqual(pieces[0], whole));
        for (int64_t r = 1; r < p; ++r) {
          EXPECT_TRUE(torch::equal(pieces[r], torch::zeros_like(whole)));
          if (torch::isFloatingType(dtype)) {
            EXPECT_TRUE(torch::signbit(pieces[r]).all().item<bool>());
          }
        }
        std::vector<size_t> order(p);
        std::iota(order.begin(), order.end(), 0);
        EXPECT_TRUE(BitEqual(SumInOrder(pieces, order), whole));
        std::reverse(order.begin(), order.end());
        EXPECT_TRUE(BitEqual(SumInOrder(pieces, order), whole)) << "reversed";
        for (int k = 0; k < 3; ++k) {
          std::shuffle(order.begin(), order.end(), rng_);
          EXPECT_TRUE(BitEqual(SumInOrder(pieces, order), whole)) << "shuffled";
        }
        EXPECT_TRUE(BitEqual(SumPairwise(pieces, 0, pieces.size()), whole)) << "pairwise";
        EXPECT_TRUE(BitEqual(whole_from_pieces(rule, pieces), whole));
      }
    }
  }
}

TEST_F(FragmentRuleTest, PartialSumComplexUsesNegativeZeroInBothParts) {
  const FragmentRule rule = FragmentRule::partial_sum("tp", 2);
  torch::Tensor whole = torch::randn({4, 3}, torch::kComplexFloat);
  torch::view_as_real(whole).view({-1})[0] = -0.0;  // real part of element 0
  torch::view_as_real(whole).view({-1})[3] = -0.0;  // imaginary part of element 1
  // Sum componentwise, as an all-reduce does (PyTorch's complex `+` multiplies
  // by alpha = 1 + 0i, which itself turns -0.0 into +0.0).
  const torch::Tensor sum = torch::view_as_real(piece_of_whole(rule, whole, 1)) +
                            torch::view_as_real(piece_of_whole(rule, whole, 0));
  EXPECT_TRUE(BitEqual(sum, torch::view_as_real(whole)));
  EXPECT_TRUE(
      torch::signbit(torch::view_as_real(piece_of_whole(rule, whole, 1))).all().item<bool>());
}

TEST_F(FragmentRuleTest, PartialSumWhyNotPositiveZeroOrWholeOverP) {
  // Filling with +0.0 flips -0.0 in the whole to +0.0.
  const torch::Tensor whole = torch::tensor({-0.0f, 1.5f, -2.0f});
  EXPECT_FALSE(BitEqual(whole + torch::zeros_like(whole), whole));
  // whole / P summed P times is right in real arithmetic, not in floating point.
  const torch::Tensor values = torch::randn({1000}, torch::kFloat32);
  const torch::Tensor third = values / 3;
  EXPECT_FALSE(BitEqual(third + third + third, values));
}

TEST_F(FragmentRuleTest, PartialSumMoeGroup) {
  const FragmentRule rule = FragmentRule::partial_sum(kTpEpGroup, 4);
  CheckRoundTrip(rule, {5, 16}, torch::kBFloat16);
  EXPECT_EQ(describe(rule), "partial sum over tp×ep = 4");
}

// ===== replicated =====

TEST_F(FragmentRuleTest, Replicated) {
  const FragmentRule rule = FragmentRule::replicated();
  EXPECT_EQ(rule.group, "tp");
  EXPECT_EQ(rule.group_size, 1);
  const torch::Tensor a = torch::randn({2, 3});
  const torch::Tensor b = torch::randn({2, 3});
  EXPECT_TRUE(whole_from_pieces(rule, {a}).is_same(a));
  EXPECT_TRUE(whole_from_pieces(FragmentRule::replicated("tp", 2), {a, b}).is_same(a));
  CheckRoundTrip(rule, {2, 3}, torch::kFloat32);
  CheckRoundTrip(FragmentRule::replicated("tp", 4), {2, 3}, torch::kInt64);
}

// ===== pieces are fresh tensors =====

TEST_F(FragmentRuleTest, PieceIsNotAViewOfTheWhole) {
  struct Case {
    FragmentRule rule;
    Shape whole;
  };
  const std::vector<Case> cases = {
      {FragmentRule::replicated(), {4, 6}},
      {FragmentRule::shard(-1, "tp", 1), {4, 6}},  // the piece is the whole
      {FragmentRule::shard(-1, "tp", 2), {4, 6}},
      {FragmentRule::shard(0, "tp", 2), {4, 6}},  // a contiguous narrow
      {FragmentRule::segments({6}, {}, "tp", 1), {4, 6}},
      {FragmentRule::segments({4, 2}, {}, "tp", 2), {4, 6}},
      {FragmentRule::qkv(2, 1, 2, 2, "tp", 1), {4, 8}},
      {FragmentRule::qkv(4, 2, 2, 2, "tp", 2), {4, 16}},
      {FragmentRule::vocab_shard(6, 6, "tp", 1), {4, 6}},
      {FragmentRule::vocab_shard(6, 8, "tp", 2), {4, 6}},
      {FragmentRule::partial_sum("tp", 2), {4, 6}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(describe(c.rule));
    for (int64_t r = 0; r < c.rule.group_size; ++r) {
      const torch::Tensor whole = torch::randn(c.whole);
      const torch::Tensor before = whole.clone();
      torch::Tensor piece = piece_of_whole(c.rule, whole, r);
      EXPECT_TRUE(piece.is_contiguous());
      EXPECT_FALSE(piece.storage().is_alias_of(whole.storage()));
      piece.fill_(7.0);
      EXPECT_TRUE(BitEqual(whole, before)) << "rank " << r;
    }
  }
}

// ===== describe =====

TEST_F(FragmentRuleTest, Describe) {
  EXPECT_EQ(describe(FragmentRule::replicated()), "replicated");
  EXPECT_EQ(describe(FragmentRule::shard(-1, "tp", 4)), "shard(-1)");
  EXPECT_EQ(describe(FragmentRule::shard(0, "tp", 4)), "shard(0)");
  EXPECT_EQ(describe(FragmentRule::segments({128, 128}, {"gate", "up"}, "tp", 2)),
            "segments gate=128 up=128");
  EXPECT_EQ(describe(FragmentRule::segments({128, 64, 32}, {}, "tp", 2)),
            "segments s0=128 s1=64 s2=32");
  EXPECT_EQ(describe(FragmentRule::qkv(4, 1, 64, 64, "tp", 2)),
            "segments q=256 k=64 v=64, kv replicas 2");
  EXPECT_EQ(describe(FragmentRule::qkv(32, 8, 128, 64, "tp", 2)), "segments q=4096 k=1024 v=512");
  EXPECT_EQ(describe(FragmentRule::partial_sum("tp", 2)), "partial sum over tp = 2");
  EXPECT_EQ(describe(FragmentRule::partial_sum(kTpEpGroup, 4)), "partial sum over tp×ep = 4");
  EXPECT_EQ(describe(FragmentRule::vocab_shard(1000, 1024, "tp", 2)),
            "vocab shard, org 1000, padded 1024");
  FragmentRule on_dim0 = FragmentRule::segments({4, 4}, {"gate", "up"}, "tp", 2);
  on_dim0.dim = 0;
  EXPECT_EQ(describe(on_dim0), "segments gate=4 up=4, dim 0");
}

// ===== collectives and equality =====

TEST_F(FragmentRuleTest, CollectiveFor) {
  EXPECT_EQ(collective_for(FragmentRule::replicated()), CollectiveKind::kNone);
  EXPECT_EQ(collective_for(FragmentRule::shard(-1, "tp", 2)), CollectiveKind::kAllGather);
  EXPECT_EQ(collective_for(FragmentRule::segments({4, 4}, {}, "tp", 2)),
            CollectiveKind::kAllGather);
  EXPECT_EQ(collective_for(FragmentRule::qkv(4, 2, 2, 2, "tp", 2)), CollectiveKind::kAllGather);
  EXPECT_EQ(collective_for(FragmentRule::vocab_shard(10, 64, "tp", 2)), CollectiveKind::kAllGather);
  EXPECT_EQ(collective_for(FragmentRule::partial_sum("tp", 2)), CollectiveKind::kAllReduce);
  EXPECT_STREQ(collective_name(CollectiveKind::kAllGather), "all_gather");
  EXPECT_STREQ(collective_name(CollectiveKind::kAllReduce), "all_reduce");
  EXPECT_STREQ(collective_name(CollectiveKind::kNone), "none");
}

// piece_is_whole says exactly when whole_from_pieces of one piece gives that piece back unchanged.
TEST_F(FragmentRuleTest, PieceIsWholeMatchesAssembly) {
  struct Case {
    FragmentRule rule;
    std::vector<int64_t> piece;
  };
  const std::vector<Case> cases = {
      {FragmentRule::replicated(), {3, 8}},
      {FragmentRule::shard(-1, "tp", 1), {3, 8}},
      {FragmentRule::segments({4, 4}, {"gate", "up"}, "tp", 1), {3, 8}},
      {FragmentRule::qkv(4, 2, 2, 2, "tp", 1), {3, 16}},
      {FragmentRule::partial_sum("tp", 1), {3, 8}},
      {FragmentRule::vocab_shard(64, 64, "tp", 1), {3, 64}},
      {FragmentRule::vocab_shard(10, 64, "tp", 1), {3, 64}},  // drops the padding: not the piece
  };
  for (const auto& c : cases) {
    const torch::Tensor piece = torch::randn(c.piece);
    const torch::Tensor whole = whole_from_pieces(c.rule, {piece});
    const bool same = whole.sizes() == piece.sizes() && torch::equal(whole, piece);
    EXPECT_EQ(piece_is_whole(c.rule), same) << c.rule;
  }
  EXPECT_FALSE(piece_is_whole(FragmentRule::shard(-1, "tp", 2)));
  EXPECT_FALSE(piece_is_whole(FragmentRule::qkv(4, 2, 2, 2, "tp", 2)));
  EXPECT_FALSE(piece_is_whole(FragmentRule::partial_sum("tp", 2)));
}

TEST_F(FragmentRuleTest, Equality) {
  EXPECT_EQ(FragmentRule::shard(-1, "tp", 2), FragmentRule::shard(-1, "tp", 2));
  EXPECT_NE(FragmentRule::shard(-1, "tp", 2), FragmentRule::shard(0, "tp", 2));
  EXPECT_NE(FragmentRule::shard(-1, "tp", 2), FragmentRule::shard(-1, "tp", 4));
  EXPECT_NE(FragmentRule::shard(-1, "tp", 2), FragmentRule::shard(-1, "ep", 2));
  EXPECT_NE(FragmentRule::partial_sum("tp", 2), FragmentRule::shard(-1, "tp", 2));
  EXPECT_NE(FragmentRule::segments({4, 4}, {"gate", "up"}, "tp", 2),
            FragmentRule::segments({4, 4}, {}, "tp", 2));
  EXPECT_NE(FragmentRule::qkv(8, 2, 4, 4, "tp", 2), FragmentRule::qkv(8, 2, 4, 2, "tp", 2));
  EXPECT_NE(FragmentRule::vocab_shard(1000, 1024, "tp", 2),
            FragmentRule::vocab_shard(1000, 1088, "tp", 2));
  FragmentRule stray = FragmentRule::shard(-1, "tp", 2);
  stray.org_vocab = 5;  // a field of another kind does not change the layout
  EXPECT_EQ(stray, FragmentRule::shard(-1, "tp", 2));
}

// ===== JSON =====

std::vector<FragmentRule> SampleRules() {
  FragmentRule segments_dim1 = FragmentRule::segments({6, 3}, {}, "tp", 3);
  segments_dim1.dim = 1;
  return {
      FragmentRule::replicated(),
      FragmentRule::replicated("ep", 4),
      FragmentRule::shard(-1, "tp", 4),
      FragmentRule::shard(0, "tp", 2),
      FragmentRule::segments({128, 128}, {"gate", "up"}, "tp", 2),
      FragmentRule::segments({12, 6, 3}, {}, "tp", 3),
      segments_dim1,
      FragmentRule::qkv(8, 2, 64, 64, "tp", 4),
      FragmentRule::qkv(32, 8, 128, 96, "tp", 2),
      FragmentRule::partial_sum("tp", 2),
      FragmentRule::partial_sum(kTpEpGroup, 8),
      FragmentRule::vocab_shard(32001, 32064, "tp", 2),
  };
}

TEST_F(FragmentRuleTest, JsonRoundTrip) {
  for (const FragmentRule& rule : SampleRules()) {
    const nlohmann::json j = to_json(rule);
    EXPECT_EQ(rule_from_json(j), rule) << j.dump();
    EXPECT_EQ(rule_from_json(nlohmann::json::parse(j.dump())), rule) << j.dump();
    const nlohmann::json adl = rule;  // ADL hooks
    EXPECT_EQ(adl, j);
    EXPECT_EQ(adl.get<FragmentRule>(), rule);
  }
  const std::vector<FragmentRule> rules = SampleRules();
  const nlohmann::json list = rules;
  EXPECT_EQ(list.get<std::vector<FragmentRule>>(), rules);
}

TEST_F(FragmentRuleTest, JsonFieldNames) {
  EXPECT_EQ(to_json(FragmentRule::shard(-1, "tp", 4)),
            nlohmann::json::parse(R"({"kind":"shard","group":"tp","group_size":4,"dim":-1})"));
  EXPECT_EQ(to_json(FragmentRule::segments({8, 4}, {"gate", "up"}, "tp", 2)),
            nlohmann::json::parse(R"({"kind":"segments","group":"tp","group_size":2,"dim":-1,
                                      "segment_sizes":[8,4],"segment_names":["gate","up"]})"));
  EXPECT_EQ(to_json(FragmentRule::segments({8, 4}, {}, "tp", 2)),
            nlohmann::json::parse(R"({"kind":"segments","group":"tp","group_size":2,"dim":-1,
                                      "segment_sizes":[8,4]})"));
  EXPECT_EQ(to_json(FragmentRule::qkv(8, 2, 64, 32, "tp", 4)),
            nlohmann::json::parse(R"({"kind":"qkv","group":"tp","group_size":4,"dim":-1,
                                      "num_heads":8,"num_kv_heads":2,"head_size":64,
                                      "v_head_size":32})"));
  EXPECT_EQ(to_json(FragmentRule::partial_sum("tp", 2)),
            nlohmann::json::parse(R"({"kind":"partial_sum","group":"tp","group_size":2})"));
  EXPECT_EQ(to_json(FragmentRule::vocab_shard(1000, 1024, "tp", 2)),
            nlohmann::json::parse(R"({"kind":"vocab_shard","group":"tp","group_size":2,"dim":-1,
                                      "org_vocab":1000,"padded_vocab":1024})"));
  EXPECT_EQ(to_json(FragmentRule::replicated()),
            nlohmann::json::parse(R"({"kind":"replicated","group":"tp","group_size":1})"));
}

TEST_F(FragmentRuleTest, JsonDefaults) {
  const FragmentRule rule = rule_from_json(nlohmann::json::parse(
      R"({"kind":"qkv","group":"tp","group_size":2,
          "num_heads":8,"num_kv_heads":2,"head_size":64})"));
  EXPECT_EQ(rule, FragmentRule::qkv(8, 2, 64, 64, "tp", 2));
}

TEST_F(FragmentRuleTest, JsonErrors) {
  using nlohmann::json;
  ExpectInvalid(
      [] { rule_from_json(json::parse(R"({"kind":"strided","group":"tp","group_size":2})")); },
      {"unknown kind 'strided'", "partial_sum"});
  ExpectInvalid([] { rule_from_json(json::parse(R"({"group":"tp","group_size":2})")); },
                {"'kind'"});
  ExpectInvalid([] { rule_from_json(json::parse(R"([1, 2])")); }, {"must be an object", "array"});
  ExpectInvalid(
      [] {
        rule_from_json(json::parse(
            R"({"kind":"qkv","group":"tp","group_size":2,"num_heads":8,"head_size":64})"));
      },
      {"missing field 'num_kv_heads'"});
  ExpectInvalid(
      [] { rule_from_json(json::parse(R"({"kind":"shard","group":"tp","group_size":2})")); },
      {"missing field 'dim'"});
  ExpectInvalid([] { rule_from_json(json::parse(R"({"kind":"partial_sum","group_size":2})")); },
                {"missing field 'group'"});
  ExpectInvalid(
      [] {
        rule_from_json(json::parse(R"({"kind":"shard","group":"tp","group_size":"4","dim":-1})"));
      },
      {"'group_size' must be an integer", "string"});
  ExpectInvalid(
      [] {
        rule_from_json(
            json::parse(R"({"kind":"shard","group":"tp","group_size":4,"dim":-1,"num_heads":8})"));
      },
      {"'num_heads'", "does not belong"});
  ExpectInvalid(
      [] {
        rule_from_json(json::parse(
            R"({"kind":"segments","group":"tp","group_size":2,"segment_sizes":[4,"x"]})"));
      },
      {"'segment_sizes' must be an integer"});
  ExpectInvalid(
      [] {
        rule_from_json(json::parse(
            R"({"kind":"vocab_shard","group":"tp","group_size":2,
                "org_vocab":1000,"padded_vocab":960})"));
      },
      {"padded_vocab 960", "org_vocab 1000"});
}

// ===== validate =====

TEST_F(FragmentRuleTest, ValidateErrors) {
  FragmentRule bad = FragmentRule::shard(-1, "tp", 2);
  bad.group_size = 0;
  ExpectInvalid([&] { validate(bad); }, {"group_size must be >= 1", "found 0"});
  bad = FragmentRule::shard(-1, "tp", 2);
  bad.group = "";
  ExpectInvalid([&] { validate(bad); }, {"group name is empty"});

  ExpectInvalid(
      [] {
        FragmentRule::segments({120, 100}, {"gate", "up"}, "tp", 3);
      },
      {"segment 1 (up)", "size 100", "group size 3"});
  ExpectInvalid(
      [] {
        FragmentRule::segments({8, 8}, {"gate"}, "tp", 2);
      },
      {"1 segment_names for 2 segment_sizes"});
  ExpectInvalid([] { FragmentRule::segments({}, {}, "tp", 2); }, {"segment_sizes is empty"});
  ExpectInvalid([] { FragmentRule::segments({8, 0}, {}, "tp", 2); }, {"segment 1 (s1)", "size 0"});

  ExpectInvalid([] { FragmentRule::qkv(6, 2, 64, 64, "tp", 4); }, {"num_heads 6", "group size 4"});
  ExpectInvalid([] { FragmentRule::qkv(12, 3, 64, 64, "tp", 4); },
                {"num_kv_heads 3", "group size 4"});
  ExpectInvalid([] { FragmentRule::qkv(12, 3, 64, 64, "tp", 2); },
                {"num_kv_heads 3", "group size 2"});
  ExpectInvalid([] { FragmentRule::qkv(8, 0, 64, 64, "tp", 2); }, {"num_kv_heads (0)"});
  ExpectInvalid([] { FragmentRule::qkv(8, 2, 64, 0, "tp", 2); }, {"v_head_size (0)"});

  ExpectInvalid([] { FragmentRule::vocab_shard(1000, 960, "tp", 2); },
                {"padded_vocab 960", "org_vocab 1000"});
  ExpectInvalid([] { FragmentRule::vocab_shard(1000, 1024, "tp", 3); },
                {"padded_vocab 1024", "group size 3"});
  ExpectInvalid([] { FragmentRule::vocab_shard(0, 64, "tp", 2); }, {"org_vocab", "found 0"});
  ExpectInvalid([] { FragmentRule::partial_sum("tp", -1); }, {"found -1"});
}

// ===== shapes =====

TEST_F(FragmentRuleTest, ShapeFunctions) {
  EXPECT_EQ(piece_shape(FragmentRule::shard(-1, "tp", 4), {2, 3, 16}), (Shape{2, 3, 4}));
  EXPECT_EQ(whole_shape(FragmentRule::shard(-1, "tp", 4), {2, 3, 4}), (Shape{2, 3, 16}));
  EXPECT_EQ(piece_shape(FragmentRule::shard(0, "tp", 4), {8, 3}), (Shape{2, 3}));
  EXPECT_EQ(whole_shape(FragmentRule::shard(0, "tp", 4), {2, 3}), (Shape{8, 3}));
  const FragmentRule gate_up = FragmentRule::segments({128, 128}, {"gate", "up"}, "tp", 2);
  EXPECT_EQ(piece_shape(gate_up, {5, 256}), (Shape{5, 128}));
  EXPECT_EQ(whole_shape(gate_up, {5, 128}), (Shape{5, 256}));
  // 8q/2kv hs 64 at tp 4: whole 8·64 + 2·64 + 2·64 = 768; piece 2·64 + 64 + 64 = 256.
  const FragmentRule qkv = FragmentRule::qkv(8, 2, 64, 64, "tp", 4);
  EXPECT_EQ(piece_shape(qkv, {7, 768}), (Shape{7, 256}));
  EXPECT_EQ(whole_shape(qkv, {7, 256}), (Shape{7, 768}));
  const FragmentRule vocab = FragmentRule::vocab_shard(32001, 32064, "tp", 2);
  EXPECT_EQ(piece_shape(vocab, {3, 32001}), (Shape{3, 16032}));
  EXPECT_EQ(whole_shape(vocab, {3, 16032}), (Shape{3, 32001}));
  EXPECT_EQ(piece_shape(FragmentRule::partial_sum("tp", 2), {3, 5}), (Shape{3, 5}));
  EXPECT_EQ(whole_shape(FragmentRule::replicated(), {}), (Shape{}));
}

TEST_F(FragmentRuleTest, ShapeErrorsNameExpectedAndFound) {
  ExpectInvalid(
      [] {
        piece_shape(FragmentRule::shard(-1, "tp", 4), {2, 10});
      },
      {"multiple of 4", "found 10", "[2, 10]"});
  ExpectInvalid(
      [] {
        piece_shape(FragmentRule::segments({128, 128}, {}, "tp", 2), {5, 200});
      },
      {"expected a whole of size 256", "found 200"});
  ExpectInvalid(
      [] {
        whole_shape(FragmentRule::segments({128, 128}, {}, "tp", 2), {5, 100});
      },
      {"expected a piece of size 128", "found 100"});
  ExpectInvalid(
      [] {
        whole_shape(FragmentRule::qkv(8, 2, 64, 64, "tp", 4), {7, 768});
      },
      {"expected a piece of size 256", "found 768"});
  ExpectInvalid(
      [] {
        piece_shape(FragmentRule::vocab_shard(1000, 1024, "tp", 2), {3, 1024});
      },
      {"expected a whole of size 1000", "found 1024"});
  ExpectInvalid(
      [] {
        piece_shape(FragmentRule::shard(2, "tp", 2), {4, 4});
      },
      {"has no dim 2", "[4, 4]"});
  ExpectInvalid([] { whole_shape(FragmentRule::shard(-1, "tp", 2), {}); }, {"has no dim -1"});
}

TEST_F(FragmentRuleTest, TensorArgumentErrors) {
  const FragmentRule rule = FragmentRule::shard(-1, "tp", 4);
  const torch::Tensor t = torch::zeros({2, 3});
  ExpectInvalid([&] { whole_from_pieces(rule, {t, t, t}); }, {"expected 4 pieces", "found 3"});
  ExpectInvalid([&] { whole_from_pieces(rule, {}); }, {"no pieces"});
  ExpectInvalid(
      [&] {
        whole_from_pieces(rule, {t, t, torch::zeros({2, 4}), t});
      },
      {"piece 2 has shape [2, 4]", "piece 0 has shape [2, 3]"});
  ExpectInvalid(
      [&] {
        whole_from_pieces(rule, {t, t, t.to(torch::kFloat64), t});
      },
      {"piece 2 has dtype Double"});
  ExpectInvalid(
      [&] {
        piece_of_whole(rule, torch::zeros({2, 8}), 4);
      },
      {"rank 4", "0 <= rank < 4"});
  ExpectInvalid([&] { piece_of_whole(rule, torch::zeros({2, 8}), -1); }, {"rank -1"});
  ExpectInvalid([&] { piece_of_whole(rule, torch::zeros(Shape{}), 0); }, {"has no dim -1"});
  ExpectInvalid(
      [&] {
        const FragmentRule gate_up = FragmentRule::segments({8, 8}, {}, "tp", 2);
        whole_from_pieces(gate_up, {torch::zeros({2, 6}), torch::zeros({2, 6})});
      },
      {"expected a piece of size 8", "found 6"});
}

TEST(FragmentTable, FragmentedLocationsInLayerOrderInputFirst) {
  FragmentTable table;
  LayerEntry qkv{"model.layers.0.self_attn.qkv_proj", "QKVParallelLinear", "QKVParallelLinear", std::nullopt,
                 FragmentedSide{FragmentRule::qkv(8, 4, 8, 8, kTpGroup, 2), 128}, {}};
  LayerEntry row{"model.layers.0.self_attn.o_proj", "RowParallelLinear", "RowParallelLinear",
                 FragmentedSide{FragmentRule::shard(-1, kTpGroup, 2), 64},
                 FragmentedSide{FragmentRule::partial_sum(kTpGroup, 2), 64}, {}};
  LayerEntry embed{"model.embed_tokens", "VocabParallelEmbedding", "VocabParallelEmbedding", std::nullopt,
                   std::nullopt, {"whole"}};
  table.layers = {qkv, embed, row};
  EXPECT_EQ(table.fragmented_locations(),
            (std::vector<std::string>{"model.layers.0.self_attn.qkv_proj.output", "model.layers.0.self_attn.o_proj.input",
                                      "model.layers.0.self_attn.o_proj.output"}));
  EXPECT_TRUE(FragmentTable{}.fragmented_locations().empty());
}

}  // namespace
}  // namespace frag::ir
