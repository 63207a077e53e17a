//===- program/captured_forwards.cpp - Forwards replayed from CUDA graphs ===//
#include "program/captured_forwards.h"

#include "ir/error.h"
#include "program/recently_used.h"

#include <fmt/ranges.h>

namespace frag::program {
namespace {

/// Copies a replay's saves out of the graph's buffers before the next replay overwrites them: one copy
/// kernel per dtype for them all (a launch per save was most of what a save cost on a replayed decode
/// step), each save a view of its part, kept in the order the forward saved them.
void keep_copies(const std::vector<std::pair<SavedValues::Slot, torch::Tensor>>& saves, SavedValues& saved) {
  if (saves.size() == 1) {
    saved.keep(saves[0].first, saves[0].second.clone());
    return;
  }
  std::vector<torch::Tensor> copies(saves.size());
  std::vector<bool> done(saves.size(), false);
  for (size_t first = 0; first < saves.size(); ++first) {
    if (done[first]) continue;
    const auto& like = saves[first].second;
    std::vector<size_t> group;
    std::vector<torch::Tensor> flat;
    for (size_t i = first; i < saves.size(); ++i) {
      const auto& buffer = saves[i].second;
      if (done[i] || buffer.scalar_type() != like.scalar_type() || buffer.device() != like.device()) continue;
      group.push_back(i);
      flat.push_back(buffer.reshape({-1}));
      done[i] = true;
    }
    const auto all = torch::cat(flat);
    int64_t offset = 0;
    for (const size_t i : group) {
      const auto& buffer = saves[i].second;
      copies[i] = all.narrow(0, offset, buffer.numel()).view(buffer.sizes());
      offset += buffer.numel();
    }
  }
  for (size_t i = 0; i < saves.size(); ++i) saved.keep(saves[i].first, std::move(copies[i]));
}

}  // namespace

CapturedForwards::Entry& CapturedForwards::entry(const Key& key, const void* weights, const torch::Tensor& input) {
  if (weights != weights_) {
    entries_.clear();
    weights_ = weights;
  }
  const auto sizes = input.sizes();
  if (auto* hit = find_recent(entries_, [&](const auto& entry) {
        return entry->dtype == input.scalar_type() && sizes.equals(entry->shape) && entry->key == key;
      }))
    return **hit;
  auto fresh = std::make_unique<Entry>();
  fresh->key = key;
  fresh->shape.assign(sizes.begin(), sizes.end());
  fresh->dtype = input.scalar_type();
  return *add_recent(entries_, std::move(fresh), kCapacity);
}

torch::Tensor CapturedForwards::run(Entry& entry, const torch::Tensor& ids, const torch::Tensor& positions,
                                    const Forward& forward) {
  if (!entry.captured()) {
    if (entry.refused || entry.eager_runs < kEagerRunsFirst) {
      ++entry.eager_runs;
      return forward.run(ids, positions);
    }
    capture(entry, ids, positions, forward);
    if (!entry.captured()) return forward.run(ids, positions);
  }
  return replay(entry, ids, positions, forward);
}

torch::Tensor CapturedForwards::replay(Entry& entry, const torch::Tensor& ids, const torch::Tensor& positions,
                                       const Forward& forward) {
  entry.input.copy_(ids);
  if (positions.defined()) entry.positions.copy_(positions);
  entry.graph->replay();
  ++stats_.replays;
  forward.interventions.replayed(entry.counts);
  if (!entry.saves.empty()) keep_copies(entry.saves, forward.saved);
  auto logits = entry.output.clone();
  try {
    // As an eager forward ends: one wait for the collectives, which throws what failed or timed out.
    forward.context.watch_replay();
    forward.context.synchronize();
  } catch (const Error& e) {
    fail("{}: forward failed: {}", forward.path, e.what());
  }
  return logits;
}

void CapturedForwards::capture(Entry& entry, const torch::Tensor& ids, const torch::Tensor& positions,
                               const Forward& forward) {
  const auto before = forward.interventions.counts();
  entry.input = ids.clone();
  if (positions.defined()) entry.positions = positions.clone();
  forward.saved.redirect(&entry.saves);  // the saves of the captured forward are buffers of the graph
  try {
    entry.graph = std::make_unique<runtime::CudaGraph>(
        [&] { entry.output = forward.run(entry.input, entry.positions); });
  } catch (const Error& e) {
    forward.saved.redirect(nullptr);
    entry.saves.clear();
    entry.input = entry.output = entry.positions = torch::Tensor();
    entry.refused = e.what();
    ++stats_.refusals;
    if (forward.context.rank() == 0)
      fmt::print(stderr, "fragments: {}: input shape [{}] runs eagerly: {}\n", forward.path,
                 fmt::join(entry.shape, ", "), e.what());
    forward.interventions.begin_forward();  // the eager forward that follows counts its own visits
    return;
  }
  forward.saved.redirect(nullptr);
  // A graph replays reading the hooks' device values where they are: it keeps them alive, whatever
  // becomes of the hooks (a plan registered again later is replayed from here).
  entry.held = forward.hook_values();
  ++stats_.captures;
  auto after = forward.interventions.counts();
  for (size_t id = 0; id < after.collectives.size(); ++id) after.collectives[id] -= before.collectives[id];
  entry.counts = std::move(after);
  forward.interventions.begin_forward();  // the replay counts them
}

}  // namespace frag::program
