//===- runtime/whole_value.h - A piece to its whole, by its rule --*- C++ -*-===//
//
// The one place that turns a rule into a collective: the triples' gathers and
// the call wrappers' outputs both assemble whole values here.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/fragment_rule.h"
#include "runtime/rank_context.h"

#include <torch/torch.h>

#include <string_view>

namespace frag::runtime {

/// The whole value of which `piece` is this rank's part under `rule`: the
/// collective the rule asks for (ir::collective_for) over the rule's group,
/// then ir::whole_from_pieces. Always a fresh tensor. A group whose size is not
/// the rule's: frag::Error naming `location`.
torch::Tensor whole_from_piece(RankContext& context, const ir::FragmentRule& rule, const torch::Tensor& piece,
                               std::string_view location);

}  // namespace frag::runtime
