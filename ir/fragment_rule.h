//===- ir/fragment_rule.h - Fragment rules and layout arithmetic -*- C++ -*-===//
//
// A fragment rule says how one rank of a tensor-parallel group holds a piece
// of a whole tensor (facts in the project's reference fragment-rules.md):
// replicated, an even shard on one dim, a fused column layer's per-part shards
// ("segments", e.g. vLLM's gate_up), a fused QKV layer (with replicated kv heads
// when the group is larger than the number of kv heads), a partial sum, or a
// padded vocab shard.
//
// This file holds the rules and their pure arithmetic on tensors only: no graph
// and no collective. The runtime runs the collective the rule asks for
// (`collective_for`), all_gather giving the pieces in group-rank order or
// all_reduce giving their sum, and then calls `whole_from_pieces` to assemble the
// whole, or `piece_of_whole` to cut this rank's piece back out of an edited
// whole. Every function here is deterministic, rank-independent in its
// decisions, and for every rule R and valid tensors:
//
//   piece_of_whole(R, whole_from_pieces(R, pieces), r) == pieces[r]   (bitwise)
//   whole_from_pieces(R, {piece_of_whole(R, whole, r) for r}) == whole (bitwise)
//
// (for kPartialSum the first identity does not hold: a sum forgets its terms).
//
// Errors a user can act on (an inconsistent rule, a tensor whose shape does not
// fit the rule, a rank out of range) throw `frag::Error` (ir/error.h) with a
// message naming the rule, what was expected and what was found.
//
// Group naming: `group` is a plain string. By convention "tp" is the tensor
// parallel group, "ep" the expert parallel group and "tp×ep" (U+00D7) the flat
// group of a FusedMoE layer whose partial sums run over tp_size·ep_size ranks
// (kTpGroup, kEpGroup, kTpEpGroup below). Nothing here interprets the name.
//
//===----------------------------------------------------------------------===//

#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include <torch/types.h>
#include <nlohmann/json.hpp>

#include "ir/error.h"
#include "ir/group_id.h"

namespace frag::ir {


/// How a rank's value relates to the whole tensor.
enum class LayoutKind {
  /// Every rank holds the whole (R). Nothing to gather.
  kReplicated,
  /// Even shard on `dim` (S(dim)): rank r holds block r of P equal blocks.
  kShard,
  /// Fused column layout [sub_0 | sub_1 | ...] on `dim`; rank r holds
  /// [sub_0 block r | sub_1 block r | ...] (vLLM MergedColumnParallelLinear).
  kSegments,
  /// Fused [Q | K | V] on `dim`; rank r holds its q heads and the kv heads of
  /// kv index r / replicas (vLLM QKVParallelLinear).
  kQkv,
  /// Partial sum (Psum): the whole is the sum of the ranks' values.
  kPartialSum,
  /// Vocab shard of padded logits on `dim`: the whole is the first `org_vocab`
  /// entries of the concatenation (vLLM ParallelLMHead / logits processor).
  kVocabShard,
};

/// The collective that turns the ranks' pieces into the whole.
enum class CollectiveKind {
  /// No collective: the value is already whole on every rank.
  kNone,
  /// all_gather of equal-shape pieces, in group-rank order.
  kAllGather,
  /// all_reduce (sum).
  kAllReduce,
};

/// A fragment rule: a layout plus the group it runs over. Only the fields of
/// the rule's kind are meaningful; the others keep their defaults. Build rules
/// with the static constructors (which validate), or fill the fields and call
/// `validate`.
struct FragmentRule {
  /// The layout.
  LayoutKind kind = LayoutKind::kReplicated;
  /// Name of the process group the layout runs over ("tp", "ep", "tp×ep", ...).
  std::string group = kTpGroup;
  /// Number of ranks in `group` (P). At least 1.
  int64_t group_size = 1;
  /// The fragmented dim (kShard, kSegments, kQkv, kVocabShard). Negative dims
  /// count from the end and are normalized against each tensor's rank.
  int64_t dim = -1;

  /// kSegments: whole size of each part along `dim`; each divisible by group_size.
  std::vector<int64_t> segment_sizes;
  /// kSegments: optional names of the parts (e.g. "gate", "up"); empty or one per part.
  std::vector<std::string> segment_names;

  /// kQkv: total number of query heads (Hq).
  int64_t num_heads = 0;
  /// kQkv: total number of key/value heads (Hkv).
  int64_t num_kv_heads = 0;
  /// kQkv: size of a query/key head (hs).
  int64_t head_size = 0;
  /// kQkv: size of a value head (vs).
  int64_t v_head_size = 0;

  /// kVocabShard: real vocab size; the whole holds entries [0, org_vocab).
  int64_t org_vocab = 0;
  /// kVocabShard: padded vocab size; divisible by group_size; per rank = padded_vocab / group_size.
  int64_t padded_vocab = 0;

  /// A replicated rule (every rank holds the whole).
  static FragmentRule replicated(std::string group = kTpGroup, int64_t group_size = 1);
  /// An even shard on `dim` over `group_size` ranks of `group`.
  static FragmentRule shard(int64_t dim, std::string group, int64_t group_size);
  /// A fused column layout with parts of whole sizes `sizes` on dim -1;
  /// `names` is empty or names each part.
  static FragmentRule segments(std::vector<int64_t> sizes, std::vector<std::string> names,
                               std::string group, int64_t group_size);
  /// A fused QKV layout on dim -1 with TOTAL head counts `num_heads` and `num_kv_heads`.
  static FragmentRule qkv(int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                          int64_t v_head_size, std::string group, int64_t group_size);
  /// A partial sum over `group_size` ranks of `group`.
  static FragmentRule partial_sum(std::string group, int64_t group_size);
  /// A padded vocab shard on dim -1: the whole keeps the first `org_vocab` of
  /// `padded_vocab` entries.
  static FragmentRule vocab_shard(int64_t org_vocab, int64_t padded_vocab, std::string group,
                                  int64_t group_size);

  /// vLLM's padded vocab size: ceil(vocab / pad) · pad (V0p in fragment-rules.md).
  /// Throws when `tp` does not divide the result (vLLM asserts the same).
  static int64_t padded_vocab_size(int64_t vocab, int64_t tp, int64_t pad = 64);

  /// kQkv: query heads per rank, num_heads / group_size.
  int64_t heads_per_rank() const;
  /// kQkv: kv heads per rank: 1 when group_size >= num_kv_heads, else num_kv_heads / group_size.
  int64_t kv_heads_per_rank() const;
  /// kQkv: how many ranks hold the same kv heads: group_size / num_kv_heads when
  /// group_size >= num_kv_heads, else 1.
  int64_t kv_replicas() const;
};

/// Two rules are equal when they describe the same layout: same kind, group,
/// group size and the fields of that kind (fields of other kinds are ignored).
bool operator==(const FragmentRule& a, const FragmentRule& b);
/// Negation of operator==.
bool operator!=(const FragmentRule& a, const FragmentRule& b);
/// Prints the rule as its JSON form (used by test frameworks).
std::ostream& operator<<(std::ostream& os, const FragmentRule& rule);

/// The JSON name of a kind: "replicated", "shard", "segments", "qkv",
/// "partial_sum" or "vocab_shard".
const char* kind_name(LayoutKind kind);

/// Throws frag::Error, naming the offending numbers, when `rule` is
/// inconsistent: group size < 1, empty group name, a segment size not
/// divisible by the group size, names not matching the parts, head counts not
/// divisible by the group size, kv heads neither dividing nor divided by the
/// group size, padded vocab smaller than the org vocab or not divisible by the
/// group size, and so on.
void validate(const FragmentRule& rule);

/// The collective that assembles the whole: kAllGather for kShard, kSegments,
/// kQkv and kVocabShard; kAllReduce for kPartialSum; kNone for kReplicated.
CollectiveKind collective_for(const FragmentRule& rule);

/// The name of a collective: "all_gather", "all_reduce" or "none".
const char* collective_name(CollectiveKind kind);

/// Whether one rank's piece is the whole as it is: a group of one rank with
/// nothing to drop (every kind but kVocabShard whose padded vocab exceeds its
/// org vocab). Then whole_from_pieces of that one piece would only copy it, so
/// callers that may alias the piece skip the call.
bool piece_is_whole(const FragmentRule& rule);

/// Assembles the whole from `pieces`, given in group-rank order (what
/// all_gather returns as a list). All pieces must have the same shape.
///  - kReplicated: returns pieces[0] (one or more pieces accepted).
///  - kShard: concatenation on `dim`.
///  - kSegments: per part, the concatenation over ranks of each piece's block
///    of that part (NOT the plain concatenation, which interleaves parts).
///  - kQkv: Q from every rank; K and V from ranks 0, rep, 2·rep, ... only
///    (the other ranks hold duplicates and are not read).
///  - kPartialSum: the pieces are partials; returns their sum, accumulated in
///    rank order ((p0 + p1) + p2 ...), in the pieces' dtype.
///  - kVocabShard: concatenation, then the first `org_vocab` entries.
/// The result (except for kReplicated) is a fresh contiguous tensor.
torch::Tensor whole_from_pieces(const FragmentRule& rule, const std::vector<torch::Tensor>& pieces);

/// Cuts rank `rank`'s piece out of `whole`. The result is always a fresh
/// contiguous tensor that does not alias `whole`.
///  - kReplicated: a copy of the whole.
///  - kShard, kSegments, kQkv: the inverse of whole_from_pieces (for kQkv, K and
///    V are taken from kv index rank / kv_replicas()).
///  - kVocabShard: the whole padded back with zeros to `padded_vocab`, narrowed
///    to the rank's block (pad entries are 0, as vLLM's pad logits are).
///  - kPartialSum: splitting a sum has no single answer. Rank 0 gets a copy of
///    the whole and every other rank a tensor filled with NEGATIVE zero (-0.0;
///    plain 0 for integer and bool dtypes; -0.0 - 0.0i for complex dtypes,
///    exact under the componentwise sum an all-reduce does).
///    Reason: the model later all-reduces these partials itself, and the
///    result must be the edited whole bit for bit. In IEEE 754 round-to-nearest
///    x + (-0.0) is x bit for bit for EVERY x, including x = -0.0 (and NaN stays
///    NaN), so whatever order or tree the all-reduce sums in, every partial
///    result is either -0.0 or exactly the whole's value (also when it
///    accumulates in a wider type and rounds back).
///    Filling with +0.0 would not do: (-0.0) + (+0.0) == +0.0 flips the sign of
///    negative zeros in the whole. DTensor and nnsight give every rank whole/P,
///    whose sum is right in real arithmetic but not bit-exact in floating point.
torch::Tensor piece_of_whole(const FragmentRule& rule, const torch::Tensor& whole, int64_t rank);

/// The whole's shape given one piece's shape. Throws frag::Error
/// naming expected vs found when the piece does not fit the rule.
std::vector<int64_t> whole_shape(const FragmentRule& rule, at::IntArrayRef piece_shape);

/// One piece's shape (the same on every rank) given the whole's shape. Throws
/// frag::Error naming expected vs found when the whole does not fit.
std::vector<int64_t> piece_shape(const FragmentRule& rule, at::IntArrayRef whole_shape);

/// Short human text, without the group for shards (callers print it apart):
/// "replicated", "shard(-1)", "segments gate=128 up=128" (or "s0=128 s1=128"
/// without names), "segments q=256 k=64 v=64, kv replicas 2" for kQkv (whole
/// widths Hq·hs, Hkv·hs, Hkv·vs; the replicas part only when > 1),
/// "partial sum over tp = 2", "vocab shard, org 1000, padded 1024".
/// Segments, qkv and vocab rules on a dim other than -1 get ", dim N" appended.
/// Never throws, even for a rule that does not validate.
std::string describe(const FragmentRule& rule);

/// The rule as JSON. Fields, by kind (always "kind", "group", "group_size"):
///  - "replicated": nothing more.
///  - "shard": "dim".
///  - "segments": "dim", "segment_sizes" (array of int), and
///    "segment_names" (array of string) only when names are set.
///  - "qkv": "dim", "num_heads", "num_kv_heads", "head_size", "v_head_size".
///  - "partial_sum": nothing more.
///  - "vocab_shard": "dim", "org_vocab", "padded_vocab".
nlohmann::json to_json(const FragmentRule& rule);

/// Reads a rule written by to_json and validates it. Required: "kind",
/// "group", "group_size" and the kind's fields, except that "dim" may be left
/// out for segments, qkv and vocab_shard (default -1), "segment_names" may be
/// left out, and "v_head_size" may be left out (default head_size). Throws
/// frag::Error on an unknown kind, a missing or mistyped field, or
/// a field that does not belong to the kind.
FragmentRule rule_from_json(const nlohmann::json& j);

/// nlohmann::json ADL hook: `nlohmann::json j = rule;`.
void to_json(nlohmann::json& j, const FragmentRule& rule);
/// nlohmann::json ADL hook: `j.get<FragmentRule>()`.
void from_json(const nlohmann::json& j, FragmentRule& rule);

}  // namespace frag::ir
