//===- ir/fragment_table.cpp - Which locations are fragmented, and how ---===//
#include "ir/fragment_table.h"

#include "ir/error.h"

#include <algorithm>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

namespace frag::ir {
namespace {

nlohmann::json side_to_json(const std::optional<FragmentedSide>& side) {
  if (!side) return nullptr;
  nlohmann::json j = {{"rule", to_json(side->rule)}};
  j["whole_width"] = side->whole_width ? nlohmann::json(*side->whole_width) : nlohmann::json(nullptr);
  return j;
}

std::optional<FragmentedSide> side_from_json(const nlohmann::json& j) {
  if (j.is_null()) return std::nullopt;
  FragmentedSide side{rule_from_json(j.at("rule")), std::nullopt};
  if (j.contains("whole_width") && !j.at("whole_width").is_null())
    side.whole_width = j.at("whole_width").get<int64_t>();
  return side;
}

}  // namespace

std::string input_location(const std::string& path) { return path + ".input"; }
std::string output_location(const std::string& path) { return path + ".output"; }

void settle_location_lists(FragmentTable& table) {
  // Linear: an 80-layer model lists about a thousand locations. The maps view the strings of the lists
  // as they came, which stay in place until the settled lists replace them.
  std::unordered_map<std::string_view, size_t> local_at;  // location -> its entry in `rank_local`
  std::vector<RankLocalLocation> rank_local;
  for (const auto& local : table.rank_local) {
    auto [seen, fresh] = local_at.try_emplace(local.location, rank_local.size());
    if (fresh) rank_local.push_back(local);
    else if (rank_local[seen->second].whole_at.empty()) rank_local[seen->second].whole_at = local.whole_at;
  }
  std::unordered_set<std::string_view> listed;
  std::vector<std::string> whole;
  for (const auto& location : table.whole)
    if (!local_at.count(location) && listed.insert(location).second) whole.push_back(location);
  table.whole = std::move(whole);
  table.rank_local = std::move(rank_local);
}

const FragmentedSide* FragmentTable::side_at(const std::string& location) const {
  for (const auto& layer : layers) {
    if (layer.input && location == input_location(layer.path)) return &*layer.input;
    if (layer.output && location == output_location(layer.path)) return &*layer.output;
  }
  return nullptr;
}

const FragmentRule* FragmentTable::rule_at(const std::string& location) const {
  const FragmentedSide* side = side_at(location);
  return side == nullptr ? nullptr : &side->rule;
}

std::vector<std::string> FragmentTable::fragmented_locations() const {
  std::vector<std::string> locations;
  for (const auto& layer : layers) {
    if (layer.input) locations.push_back(input_location(layer.path));
    if (layer.output) locations.push_back(output_location(layer.path));
  }
  return locations;
}

const LayerEntry* FragmentTable::layer(const std::string& path) const {
  for (const auto& layer : layers)
    if (layer.path == path) return &layer;
  return nullptr;
}

nlohmann::json to_json(const FragmentTable& table) {
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& layer : table.layers)
    layers.push_back({{"path", layer.path},
                      {"class", layer.class_name},
                      {"kind", layer.kind},
                      {"input", side_to_json(layer.input)},
                      {"output", side_to_json(layer.output)},
                      {"notes", layer.notes}});
  nlohmann::json rank_local = nlohmann::json::array();
  for (const auto& local : table.rank_local) {
    nlohmann::json entry = {{"location", local.location}, {"derived_from", local.derived_from}};
    if (!local.whole_at.empty()) entry["whole_at"] = local.whole_at;
    rank_local.push_back(std::move(entry));
  }
  return {{"format", kTableFormat},
          {"tp_size", table.tp_size},
          {"layers", layers},
          {"whole", table.whole},
          {"rank_local", rank_local}};
}

FragmentTable table_from_json(const nlohmann::json& json, const std::string& source) {
  try {
    if (json.value("format", "") != kTableFormat)
      fail("{}: fragment table format is '{}', expected '{}'", source, json.value("format", ""),
           kTableFormat);
    FragmentTable table;
    table.tp_size = json.at("tp_size").get<int64_t>();
    for (const auto& j : json.at("layers")) {
      LayerEntry layer;
      layer.path = j.at("path").get<std::string>();
      layer.class_name = j.at("class").get<std::string>();
      layer.kind = j.at("kind").get<std::string>();
      layer.input = side_from_json(j.at("input"));
      layer.output = side_from_json(j.at("output"));
      layer.notes = j.value("notes", std::vector<std::string>{});
      table.layers.push_back(std::move(layer));
    }
    table.whole = json.value("whole", std::vector<std::string>{});
    for (const auto& j : json.value("rank_local", nlohmann::json::array()))
      table.rank_local.push_back({j.at("location").get<std::string>(), j.at("derived_from").get<std::string>(),
                                  j.value("whole_at", std::string())});
    return table;
  } catch (const nlohmann::json::exception& e) {
    fail("{}: malformed fragment table: {}", source, e.what());
  } catch (const Error& e) {
    fail("{}: malformed fragment rule in table: {}", source, e.what());
  }
}

bool operator==(const FragmentedSide& a, const FragmentedSide& b) {
  return a.rule == b.rule && a.whole_width == b.whole_width;
}

bool operator==(const LayerEntry& a, const LayerEntry& b) {
  return a.path == b.path && a.class_name == b.class_name && a.kind == b.kind &&
         a.input == b.input && a.output == b.output;
}

}  // namespace frag::ir
