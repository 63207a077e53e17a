//===- program/inspect_report.h - What frag inspect reports -----*- C++ -*-===//
#pragma once

#include "ir/fragment_table.h"
#include "ir/head_layout.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace frag::program {

/// Head layouts by location (ir::head_layout), for the locations that have one.
using HeadLayouts = std::map<std::string, ir::HeadLayout>;

/// The head layout of every layer side of `table` that has one; `layout_of(location)` computes it
/// (ir::head_layout with the model's configs; ShardedModel::head_layout for a loaded model).
HeadLayouts head_layouts_of(const ir::FragmentTable& table,
                            const std::function<ir::HeadLayout(const std::string& location)>& layout_of);

/// The inspect report of one export (all rank files agree; the first is shown).
/// `heads`: the attention heads of its locations (a section of their own).
std::string inspect_text(const ir::FragmentTable& table, const std::vector<std::string>& files, bool all,
                         const HeadLayouts& heads = {});
/// The same as a stable JSON document (format "fragments.inspect/1"; README documents it); "heads" maps locations to their regions.
nlohmann::json inspect_json(const ir::FragmentTable& table, const std::vector<std::string>& files,
                            const HeadLayouts& heads = {});

}  // namespace frag::program
