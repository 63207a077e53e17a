//===- ir/location_table.cpp - Every location indexed once ---------------===//
#include "ir/location_table.h"

#include "ir/error.h"

#include <fmt/ranges.h>

#include <algorithm>

namespace frag::ir {
namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

}  // namespace

LocationTable::LocationTable(FragmentTable table) : table_(std::move(table)) {
  auto add = [this](LocationEntry entry) {
    // A name listed twice keeps its first id (the table lists each once).
    if (ids_.emplace(entry.name, static_cast<LocationId>(entries_.size())).second)
      entries_.push_back(std::move(entry));
  };
  for (size_t i = 0; i < table_.layers.size(); ++i) {
    const auto& layer = table_.layers[i];
    layers_.emplace(layer.path, i);
    if (layer.input)
      add({input_location(layer.path), LocationKind::kFragmented, layer.input, group_id(layer.input->rule.group), ""});
    if (layer.output)
      add({output_location(layer.path), LocationKind::kFragmented, layer.output, group_id(layer.output->rule.group), ""});
  }
  for (const auto& name : table_.whole) add({name, LocationKind::kWhole, std::nullopt, std::nullopt, ""});
  for (const auto& local : table_.rank_local)
    add({local.location, LocationKind::kRankLocal, std::nullopt, std::nullopt, local.derived_from});
}

std::optional<LocationId> LocationTable::find(std::string_view name) const {
  auto it = ids_.find(std::string(name));
  if (it == ids_.end()) return std::nullopt;
  return it->second;
}

LocationId LocationTable::id_of(const std::string& name, const std::string& what) const {
  if (auto id = find(name)) return *id;
  std::vector<std::string> names;
  names.reserve(entries_.size());
  for (const auto& entry : entries_) names.push_back(entry.name);
  const auto close = closest_names(name, names);
  fail("{}: unknown location '{}'{}; `frag inspect --all FILE` lists every location", what, name,
       close.empty() ? "" : fmt::format(" (did you mean {}?)", fmt::join(close, ", ")));
}

LocationKind LocationTable::kind_of(std::string_view name) const {
  auto id = find(name);
  return id ? entries_[static_cast<size_t>(*id)].kind : LocationKind::kUnknown;
}

const FragmentedSide* LocationTable::side_at(std::string_view name) const {
  auto id = find(name);
  if (!id) return nullptr;
  const auto& side = entries_[static_cast<size_t>(*id)].side;
  return side ? &*side : nullptr;
}

const LayerEntry* LocationTable::layer(std::string_view path) const {
  auto it = layers_.find(std::string(path));
  return it == layers_.end() ? nullptr : &table_.layers[it->second];
}

std::vector<std::string> closest_names(const std::string& name, const std::vector<std::string>& candidates,
                                       size_t count) {
  std::vector<std::pair<size_t, const std::string*>> scored;
  scored.reserve(candidates.size());
  for (const auto& candidate : candidates) scored.emplace_back(edit_distance(name, candidate), &candidate);
  std::stable_sort(scored.begin(), scored.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  // Only plausible typos: at most a third of the name changed.
  std::vector<std::string> close;
  for (const auto& [distance, candidate] : scored) {
    if (close.size() == count || distance * 3 > name.size()) break;
    close.push_back(*candidate);
  }
  return close;
}

}  // namespace frag::ir
