//===- program/recently_used.h - Small caches, least recently used first -*- C++ -*-===//
//
// The program's caches (forward_cache, captured_forwards) hold a few entries in
// a vector, least recently used first: a hit moves to the back, a new entry is
// appended there and the front one goes when the cache is full.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <algorithm>
#include <vector>

namespace frag::program {

/// The entry `matches` accepts, moved to the back as the most recently used; nullptr where none does.
template <typename T, typename Match>
T* find_recent(std::vector<T>& entries, Match matches) {
  auto hit = std::find_if(entries.begin(), entries.end(), matches);
  if (hit == entries.end()) return nullptr;
  std::rotate(hit, hit + 1, entries.end());
  return &entries.back();
}

/// Appends `entry` as the most recently used, first dropping the least recently used if `capacity` are held.
template <typename T>
T& add_recent(std::vector<T>& entries, T entry, size_t capacity) {
  if (entries.size() >= capacity) entries.erase(entries.begin());
  entries.push_back(std::move(entry));
  return entries.back();
}

}  // namespace frag::program
