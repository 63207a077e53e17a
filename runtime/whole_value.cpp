//===- runtime/whole_value.cpp - A piece to its whole, by its rule -------===//
#include "runtime/whole_value.h"

#include "ir/error.h"

namespace frag::runtime {

torch::Tensor whole_from_piece(RankContext& context, const ir::FragmentRule& rule, const torch::Tensor& piece,
                               std::string_view location) {
  Communicator& group = context.group(rule.group);
  if (group.size() != rule.group_size)
    fail("{} is fragmented over {} ranks of group '{}', but this run's group has {}", location, rule.group_size,
         rule.group, group.size());
  switch (ir::collective_for(rule)) {
    case ir::CollectiveKind::kAllReduce:
      return group.all_reduce(piece);
    case ir::CollectiveKind::kAllGather:
      return ir::whole_from_pieces(rule, group.all_gather(piece));
    case ir::CollectiveKind::kNone:
      break;
  }
  return piece.clone();
}

}  // namespace frag::runtime
