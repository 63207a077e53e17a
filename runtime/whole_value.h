//===- runtime/whole_value.h - A piece to its whole, by its rule --*- C++ -*-===//
//
// The one place that turns a rule into a collective: the triples' gathers and
// the call wrappers' outputs both assemble whole values here.
//
// Assembly is fused: an all-gather rule runs one all-gather into one buffer
// [group size, *piece shape] and one copy from it: none for a shard on dim 0
// (a view of the buffer); one permuted copy where the whole is several equal
// parts of each piece, part-major (gate_up); one cat of views, a single
// batched copy kernel on CUDA, for the rest (shards on other dims, qkv with or
// without replicated kv heads, uneven segments, the padded vocab shard, whose
// padding is never read). A
// partial sum is one all-reduce. Which gathered entry lands where is computed
// once per (rule, piece shape, device) by running ir::whole_from_pieces /
// ir::piece_of_whole on position numbers, so the result is bit-identical to
// theirs by construction.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/fragment_rule.h"
#include "runtime/rank_context.h"

#include <torch/types.h>

#include <string_view>

namespace frag::runtime {

/// The whole value of which `piece` is this rank's part under `rule`: the
/// collective the rule asks for (ir::collective_for) over `group` (the rule's),
/// then the fused assembly. Always a fresh tensor. A group whose size is not
/// the rule's: frag::Error naming `location`.
torch::Tensor whole_from_piece(Communicator& group, const ir::FragmentRule& rule, const torch::Tensor& piece,
                               std::string_view location);

/// ir::whole_from_pieces(rule, gathered.unbind(0)) for an all-gather rule, in
/// one copy (none for a shard on dim 0): `gathered` is [group size, *piece].
torch::Tensor whole_from_gathered(const ir::FragmentRule& rule, const torch::Tensor& gathered);

/// ir::piece_of_whole(rule, whole, rank) in one copy for an all-gather rule
/// (falls back to ir::piece_of_whole for the others). Always a fresh tensor.
torch::Tensor piece_from_whole(const ir::FragmentRule& rule, const torch::Tensor& whole, int64_t rank);

}  // namespace frag::runtime
