//===- ir/group_id.h - The groups a rank connects, by name and by id -*- C++ -*-===//
//
// Rules name their group with a string (it is what a table's JSON holds); a
// name is turned into a GroupId once, when a table is loaded
// (ir::LocationTable), so the collectives of a forward index an array
// (runtime::RankContext::group) instead of looking a string up.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace frag::ir {

/// Conventional name of the tensor parallel group.
inline constexpr const char* kTpGroup = "tp";
/// Conventional name of the expert parallel group.
inline constexpr const char* kEpGroup = "ep";
/// Conventional name of the flat tp·ep group over which a FusedMoE partial sum runs.
inline constexpr const char* kTpEpGroup = "tp×ep";
/// The group of every rank.
inline constexpr const char* kWorldGroup = "world";

enum class GroupId : uint8_t { kTp, kEp, kTpEp, kWorld };
inline constexpr size_t kGroupCount = 4;

/// The name of a group id.
constexpr const char* group_name(GroupId id) {
  constexpr const char* kNames[kGroupCount] = {kTpGroup, kEpGroup, kTpEpGroup, kWorldGroup};
  return kNames[static_cast<size_t>(id)];
}

/// The id of a group name; nullopt for a name no rank connects.
inline std::optional<GroupId> group_id(std::string_view name) {
  for (size_t i = 0; i < kGroupCount; ++i)
    if (name == group_name(static_cast<GroupId>(i))) return static_cast<GroupId>(i);
  return std::nullopt;
}

}  // namespace frag::ir
