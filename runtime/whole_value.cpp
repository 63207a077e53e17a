//===- runtime/whole_value.cpp - A piece to its whole, by its rule -------===//
#include "runtime/whole_value.h"

#include "ir/error.h"

#include <c10/core/WrapDimMinimal.h>

#include <array>
#include <memory>
#include <map>
#include <mutex>

namespace frag::runtime {
namespace {

/// Where the whole's entries along the rule's dim come from (assembly), or
/// which entries of the whole a rank keeps (cut), on one device.
struct IndexPlan {
  int64_t dim = 0;
  bool identity = false;   ///< assembly: the gathered buffer in order, nothing dropped
  /// assembly: the whole is `blocks` ≥ 2 equal parts per piece, part-major
  /// then rank (gate_up: 2): one permuted copy, where a cat would copy
  /// 2·ranks runs. Plain shards take the cat (its kernel moved them faster
  /// than a permuted copy at 128–512 tokens on an H200).
  int64_t blocks = 0;
  bool fallback = false;   ///< cut: entries the whole does not hold (vocab padding): use the reference
  /// assembly otherwise: runs {rank, offset, length} of consecutive entries of
  /// one piece, in the whole's order; one cat of views copies them (one kernel).
  std::vector<std::array<int64_t, 3>> runs;
  torch::Tensor offset;    ///< cut: the whole's entries this rank keeps
};

/// A rule's layout fields, the shape and the device: equal keys give equal plans.
using Key = std::vector<int64_t>;

Key key_of(const ir::FragmentRule& rule, at::IntArrayRef shape, const torch::Device& device, int64_t what) {
  Key key;
  key.reserve(16 + rule.segment_sizes.size() + shape.size());
  key = {what,
          static_cast<int64_t>(rule.kind),
          rule.group_size,
          rule.dim,
          rule.num_heads,
          rule.num_kv_heads,
          rule.head_size,
          rule.v_head_size,
          rule.org_vocab,
          rule.padded_vocab,
          static_cast<int64_t>(device.type()),
          device.index(),
          static_cast<int64_t>(rule.segment_sizes.size())};
  key.insert(key.end(), rule.segment_sizes.begin(), rule.segment_sizes.end());
  key.insert(key.end(), shape.begin(), shape.end());
  return key;
}

/// Plans are small (index vectors along one dim); a forward uses a few dozen.
/// Bounded, so shapes that change every call (decode steps) cannot grow it.
class PlanCache {
 public:
  /// Shared, so a hit copies no vectors and a clear() cannot pull a plan from under a user.
  template <typename Make>
  std::shared_ptr<const IndexPlan> get(const Key& key, Make make) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = plans_.find(key);
      if (it != plans_.end()) return it->second;
    }
    auto plan = std::make_shared<const IndexPlan>(make());
    std::lock_guard<std::mutex> lock(mutex_);
    if (plans_.size() >= kMaxPlans) plans_.clear();
    plans_.emplace(key, plan);
    return plan;
  }

 private:
  static constexpr size_t kMaxPlans = 1024;
  std::mutex mutex_;
  std::map<Key, std::shared_ptr<const IndexPlan>> plans_;
};

PlanCache& plan_cache() {
  static PlanCache cache;
  return cache;
}

/// A shape of ones of `ndim` dims with `size` at `dim`: position numbers along one dim.
std::vector<int64_t> line_shape(int64_t ndim, int64_t dim, int64_t size) {
  std::vector<int64_t> shape(static_cast<size_t>(ndim), 1);
  shape[static_cast<size_t>(dim)] = size;
  return shape;
}

IndexPlan make_assembly_plan(const ir::FragmentRule& rule, at::IntArrayRef piece_shape, const torch::Device& device) {
  const int64_t ndim = static_cast<int64_t>(piece_shape.size());
  IndexPlan plan;
  plan.dim = c10::maybe_wrap_dim(rule.dim, ndim);
  const int64_t size = piece_shape[static_cast<size_t>(plan.dim)];
  const int64_t ranks = rule.group_size;
  // Number every entry of every rank's piece along the dim, assemble the
  // numbers as the rule assembles values, and read off where each came from.
  std::vector<torch::Tensor> numbers;
  for (int64_t r = 0; r < ranks; ++r)
    numbers.push_back(torch::arange(r * size, (r + 1) * size, torch::kLong).view(line_shape(ndim, plan.dim, size)));
  torch::Tensor source = ir::whole_from_pieces(rule, numbers).reshape({-1}).contiguous();
  plan.identity = source.numel() == ranks * size && torch::equal(source, torch::arange(ranks * size, torch::kLong));
  // Equal parts, part-major: whole[s, r, j] = piece_r[s * part + j]. A strided
  // copy with no index tensors reads fewer bytes and launches cheaper than a gather.
  if (source.numel() == ranks * size)
    for (int64_t blocks : {int64_t{2}, int64_t{3}, int64_t{4}}) {
      if (size % blocks != 0) continue;
      const int64_t part = size / blocks;
      auto expected = (torch::arange(ranks, torch::kLong).view({1, ranks, 1}) * size +
                       torch::arange(blocks, torch::kLong).view({blocks, 1, 1}) * part +
                       torch::arange(part, torch::kLong).view({1, 1, part}))
                          .reshape({-1});
      if (torch::equal(source, expected)) {
        plan.blocks = blocks;
        break;
      }
    }
  const auto* from = source.data_ptr<int64_t>();
  for (int64_t i = 0; i < source.numel(); ++i) {
    const int64_t rank = from[i] / size, offset = from[i] % size;
    auto& runs = plan.runs;
    if (!runs.empty() && runs.back()[0] == rank && runs.back()[1] + runs.back()[2] == offset) ++runs.back()[2];
    else runs.push_back({rank, offset, 1});
  }
  (void)device;
  return plan;
}

IndexPlan make_cut_plan(const ir::FragmentRule& rule, at::IntArrayRef whole_shape, int64_t rank,
                        const torch::Device& device) {
  const int64_t ndim = static_cast<int64_t>(whole_shape.size());
  IndexPlan plan;
  plan.dim = c10::maybe_wrap_dim(rule.dim, ndim);
  const int64_t size = whole_shape[static_cast<size_t>(plan.dim)];
  // Numbered from 1: whatever the reference fills in (vocab padding) shows as out of range.
  torch::Tensor numbers = torch::arange(1, size + 1, torch::kLong).view(line_shape(ndim, plan.dim, size));
  torch::Tensor kept = ir::piece_of_whole(rule, numbers, rank).reshape({-1}).contiguous();
  plan.fallback = kept.numel() > 0 && (kept.min().item<int64_t>() < 1 || kept.max().item<int64_t>() > size);
  plan.offset = (kept - 1).to(device);
  return plan;
}

}  // namespace

torch::Tensor whole_from_gathered(const ir::FragmentRule& rule, const torch::Tensor& gathered) {
  if (ir::collective_for(rule) != ir::CollectiveKind::kAllGather)
    fail("whole_from_gathered: a {} rule needs no all-gather", ir::kind_name(rule.kind));
  if (gathered.dim() < 2 || gathered.size(0) != rule.group_size)
    fail("whole_from_gathered: expected [{}, piece...] for a group of {}, got a tensor of {} dims", rule.group_size,
         rule.group_size, gathered.dim());
  const auto piece_shape = gathered.sizes().slice(1);
  const auto shared = plan_cache().get(key_of(rule, piece_shape, gathered.device(), 0),
                                       [&] { return make_assembly_plan(rule, piece_shape, gathered.device()); });
  const IndexPlan& plan = *shared;
  if (plan.identity && plan.dim == 0) {
    // Rank-major blocks on dim 0 are the whole already: a view of the fresh buffer.
    std::vector<int64_t> shape(piece_shape.begin(), piece_shape.end());
    shape[0] *= rule.group_size;
    return gathered.view(shape);
  }
  if (plan.blocks > 0) {
    // [ranks, pre, blocks, part, post] → [pre, blocks, ranks, part, post]: one copy.
    int64_t pre = 1, post = 1;
    for (int64_t d = 0; d < plan.dim; ++d) pre *= piece_shape[static_cast<size_t>(d)];
    for (size_t d = static_cast<size_t>(plan.dim) + 1; d < piece_shape.size(); ++d) post *= piece_shape[d];
    const int64_t size = piece_shape[static_cast<size_t>(plan.dim)];
    std::vector<int64_t> shape(piece_shape.begin(), piece_shape.end());
    shape[static_cast<size_t>(plan.dim)] *= rule.group_size;
    return gathered.view({rule.group_size, pre, plan.blocks, size / plan.blocks, post})
        .permute({1, 2, 0, 3, 4})
        .contiguous()
        .view(shape);
  }
  // Unequal parts (qkv, replicated kv heads) or padding (vocab): views of the
  // runs, one cat (CUDA copies all of them in one batched kernel).
  if (plan.runs.empty()) return ir::whole_from_pieces(rule, gathered.unbind(0));  // an empty whole
  std::vector<torch::Tensor> parts;
  parts.reserve(plan.runs.size());
  // Views cost host time per op: one unbind, and a narrow only where a run is part of a piece.
  const auto rows = gathered.unbind(0);
  const int64_t size = piece_shape[static_cast<size_t>(plan.dim)];
  for (const auto& [rank, offset, length] : plan.runs)
    parts.push_back(offset == 0 && length == size ? rows[static_cast<size_t>(rank)]
                                                  : rows[static_cast<size_t>(rank)].narrow(plan.dim, offset, length));
  return torch::cat(parts, plan.dim);
}

torch::Tensor piece_from_whole(const ir::FragmentRule& rule, const torch::Tensor& whole, int64_t rank) {
  if (ir::collective_for(rule) != ir::CollectiveKind::kAllGather) return ir::piece_of_whole(rule, whole, rank);
  if (rank < 0 || rank >= rule.group_size) return ir::piece_of_whole(rule, whole, rank);  // its error
  const auto shared = plan_cache().get(key_of(rule, whole.sizes(), whole.device(), 1 + rank),
                                       [&] { return make_cut_plan(rule, whole.sizes(), rank, whole.device()); });
  const IndexPlan& plan = *shared;
  if (plan.fallback) return ir::piece_of_whole(rule, whole, rank);
  return whole.index_select(plan.dim, plan.offset);
}

torch::Tensor whole_from_piece(Communicator& group, const ir::FragmentRule& rule, const torch::Tensor& piece,
                               std::string_view location) {
  if (group.size() != rule.group_size)
    fail("{} is fragmented over {} rank{} of group '{}', but this run's group has {}", location, rule.group_size,
         rule.group_size == 1 ? "" : "s", rule.group, group.size());
  switch (ir::collective_for(rule)) {
    case ir::CollectiveKind::kAllReduce:
      return group.all_reduce(piece);
    case ir::CollectiveKind::kAllGather:
      return whole_from_gathered(rule, group.all_gather_stacked(piece));
    case ir::CollectiveKind::kNone:
      break;
  }
  return piece.clone();
}

}  // namespace frag::runtime
