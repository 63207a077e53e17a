//===- program/inspect_report.cpp - What frag inspect reports -------------===//
//
// The report of a fragment table, as text for people and as JSON ("fragments.inspect/1") for programs:
// the CLI's `frag inspect` and the Python front end's Model.inspect_json print the same thing.
//
//===----------------------------------------------------------------------===//
#include "program/inspect_report.h"

#include "ir/module_path.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace frag::program {
namespace {

/// One fragmented location, flattened for reports.
struct Row {
  std::string location, class_name, kind, side, layout, whole, group;
  const ir::FragmentedSide* fragment;
};

std::vector<Row> fragmented_rows(const ir::FragmentTable& table) {
  std::vector<Row> rows;
  for (const auto& layer : table.layers) {
    for (const auto* side : {&layer.input, &layer.output}) {
      if (!*side) continue;
      const bool input = side == &layer.input;
      const auto& rule = (*side)->rule;
      rows.push_back(Row{input ? ir::input_location(layer.path) : ir::output_location(layer.path),
                         layer.class_name, layer.kind, input ? "input" : "output", ir::describe(rule),
                         (*side)->whole_width ? fmt::format("[..., {}]", *(*side)->whole_width) : "?",
                         fmt::format("{} ({} rank{})", rule.group, rule.group_size, rule.group_size == 1 ? "" : "s"), &**side});
    }
  }
  return rows;
}

}  // namespace

std::string inspect_text(const ir::FragmentTable& table, const std::vector<std::string>& files,
                         bool all, const HeadLayouts& heads) {
  std::string out = fmt::format("{}: tp_size {}, {} parallel layers\n", fmt::join(files, ", "),
                                table.tp_size, table.layers.size());
  auto rows = fragmented_rows(table);
  out += fmt::format("\nfragmented locations ({}): this rank holds a piece; frag shows the whole\n", rows.size());
  size_t w_loc = 8, w_class = 5, w_layout = 6, w_whole = 5;
  for (const auto& r : rows) {
    w_loc = std::max(w_loc, r.location.size());
    w_class = std::max(w_class, r.class_name.size());
    w_layout = std::max(w_layout, r.layout.size());
    w_whole = std::max(w_whole, r.whole.size());
  }
  if (!rows.empty())
    out += fmt::format("  {:<{}}  {:<{}}  {:<{}}  {:<{}}  {}\n", "LOCATION", w_loc, "CLASS", w_class,
                       "LAYOUT", w_layout, "WHOLE", w_whole, "GROUP");
  for (const auto& r : rows)
    out += fmt::format("  {:<{}}  {:<{}}  {:<{}}  {:<{}}  {}\n", r.location, w_loc, r.class_name,
                       w_class, r.layout, w_layout, r.whole, w_whole, r.group);
  if (!heads.empty()) {
    out += fmt::format("\nattention heads ({}): the last dim in heads, whole coordinates; plans name them by "
                       "\"segment\" and \"heads\"\n", heads.size());
    size_t width = 0;
    for (const auto& [location, _] : heads) width = std::max(width, location.size());
    for (const auto& [location, layout] : heads) {
      std::vector<std::string> regions;
      for (const auto& r : layout)
        regions.push_back(fmt::format("{} {}:{} ({} heads, head_dim {})", r.name, r.start, r.stop, r.heads(), r.head_dim));
      out += fmt::format("  {:<{}}  {}\n", location, width, fmt::join(regions, ", "));
    }
  }
  out += fmt::format("\nrank-local values ({}): derived from a fragment, not whole on any rank\n",
                     table.rank_local.size());
  for (const auto& local : table.rank_local)
    out += fmt::format("  {}  (from {})\n", local.location, local.derived_from);
  out += fmt::format("\nwhole locations ({}): every rank holds the whole value{}\n", table.whole.size(),
                     all ? "" : " (list them with --all)");
  if (all)
    for (const auto& location : table.whole) out += fmt::format("  {}\n", location);
  return out;
}

HeadLayouts head_layouts_of(const ir::FragmentTable& table,
                            const std::function<ir::HeadLayout(const std::string& location)>& layout_of) {
  HeadLayouts layouts;
  for (const auto& layer : table.layers)
    for (const auto& location : {ir::input_location(layer.path), ir::output_location(layer.path)})
      if (auto layout = layout_of(location); !layout.empty()) layouts.emplace(location, std::move(layout));
  return layouts;
}

nlohmann::json inspect_json(const ir::FragmentTable& table, const std::vector<std::string>& files,
                            const HeadLayouts& heads) {
  nlohmann::json fragmented = nlohmann::json::array();
  for (const auto& r : fragmented_rows(table)) {
    fragmented.push_back({{"location", r.location},
                          {"class", r.class_name},
                          {"kind", r.kind},
                          {"side", r.side},
                          {"layout", r.layout},
                          {"rule", ir::to_json(r.fragment->rule)},
                          {"whole_width", r.fragment->whole_width ? nlohmann::json(*r.fragment->whole_width)
                                                                  : nlohmann::json(nullptr)},
                          {"group", r.fragment->rule.group},
                          {"group_size", r.fragment->rule.group_size}});
  }
  nlohmann::json rank_local = nlohmann::json::array();
  for (const auto& local : table.rank_local) {
    nlohmann::json entry = {{"location", local.location}, {"derived_from", local.derived_from}};
    if (!local.whole_at.empty()) entry["whole_at"] = local.whole_at;  // as the rewritten file's table has it
    rank_local.push_back(std::move(entry));
  }
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& layer : table.layers)
    layers.push_back({{"path", layer.path}, {"class", layer.class_name}, {"kind", layer.kind},
                      {"notes", layer.notes}});
  nlohmann::json head_regions = nlohmann::json::object();
  for (const auto& [location, layout] : heads)
    for (const auto& r : layout)
      head_regions[location][r.name] = {
          {"start", r.start}, {"stop", r.stop}, {"heads", r.heads()}, {"head_dim", r.head_dim}};
  // null, not empty, where the graph was not analysed: "none" would be a claim.
  return {{"format", "fragments.inspect/1"},
          {"files", files},
          {"tp_size", table.tp_size},
          {"fragmented", fragmented},
          {"rank_local", rank_local},
          {"whole", table.whole},
          {"layers", layers},
          {"heads", head_regions}};
}

}  // namespace frag::program
