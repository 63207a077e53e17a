//===- ir/location_table.h - Every location indexed once ---------*- C++ -*-===//
//
// The fragment table (ir/fragment_table.h) is what a rank file stores; this is
// the form the runtime uses. At load every location gets a small integer id
// and one entry (name, kind, rule and whole width where fragmented); the
// rewritten graph's ops are bound to these ids (passes/bind_location_ids), so
// a kernel indexes a vector: no string hashing, no rule parsing, no scan.
//
// Ids are dense and follow the table: fragmented locations in layer order (a
// layer's input before its output), then whole locations, then rank-local ones.
// Equal tables give equal ids on every rank.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/fragment_table.h"
#include "ir/group_id.h"

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace frag::ir {

using LocationId = int64_t;

/// What a location's value is on each rank.
enum class LocationKind {
  kFragmented,  ///< a piece of the whole (a parallel layer's input or output)
  kWhole,       ///< whole on every rank (a decoder layer's output, the residual stream)
  kRankLocal,   ///< derived from a piece, at no fragmented boundary: no rank holds a whole
  kUnknown,     ///< not a location of this model
};

/// One location.
struct LocationEntry {
  std::string name;
  LocationKind kind = LocationKind::kUnknown;
  std::optional<FragmentedSide> side;  ///< fragmented locations only
  std::optional<GroupId> group;        ///< fragmented locations: the rule's group, bound at load (nullopt: unknown)
  std::string derived_from;            ///< rank-local locations only
};

/// The locations of one rank file, by id and by name.
class LocationTable {
 public:
  LocationTable() = default;
  explicit LocationTable(FragmentTable table);

  const FragmentTable& fragments() const { return table_; }
  size_t size() const { return entries_.size(); }
  const LocationEntry& at(LocationId id) const { return entries_.at(static_cast<size_t>(id)); }

  /// The id of `name`, or nullopt.
  std::optional<LocationId> find(std::string_view name) const;
  /// The id of `name`; unknown: frag::Error starting with `what`, with the
  /// closest location names as suggestions.
  LocationId id_of(const std::string& name, const std::string& what) const;
  /// The kind of `name` (kUnknown if it is none of this model's locations).
  LocationKind kind_of(std::string_view name) const;
  /// The fragmented side at `name`, or nullptr.
  const FragmentedSide* side_at(std::string_view name) const;
  /// The layer entry of a module path, or nullptr.
  const LayerEntry* layer(std::string_view path) const;

 private:
  FragmentTable table_;
  std::vector<LocationEntry> entries_;
  std::unordered_map<std::string, LocationId> ids_;
  std::unordered_map<std::string, size_t> layers_;
};

/// Up to `count` names of `candidates` closest to `name` (edit distance), for "did you mean".
std::vector<std::string> closest_names(const std::string& name, const std::vector<std::string>& candidates,
                                       size_t count = 3);

}  // namespace frag::ir
