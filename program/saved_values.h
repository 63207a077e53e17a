//===- program/saved_values.h - Saved whole tensors, by slot and step -*- C++ -*-===//
//
// A save's name becomes a slot when its step is registered; a visit keeps its
// value under (slot, generation step) with no string work and no map search.
// The public view by name ("name", or "step{k}.name" during generation) is
// built when it is read, from the values kept since, in the order they were kept.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace frag::program {

/// Saved whole tensors by name, in the order they were captured.
using SavedTensors = std::map<std::string, std::vector<torch::Tensor>>;

class SavedValues {
 public:
  using Slot = uint32_t;

  /// The slot of a save name (at registration): one name, one slot, for the model's lifetime.
  Slot slot(const std::string& name);
  /// The generation step whose saves follow, keyed "step{k}.name"; nullopt: keyed by the name alone.
  void set_step(std::optional<int64_t> step) { step_ = step; }
  /// Saves keep only the first `rows` rows (dim 0) of what they see: a decode step padded to a batch
  /// bucket (program/decoder.h) saves its real rows. nullopt: every row.
  void set_rows(std::optional<int64_t> rows) { rows_ = rows; }
  /// Keeps a value a visit saved. While redirected (a CUDA graph's capture) it goes to those buffers.
  void keep(Slot slot, torch::Tensor value);
  /// Sends keep() to `buffers` (nullptr: back to the store).
  void redirect(std::vector<std::pair<Slot, torch::Tensor>>* buffers) { redirect_ = buffers; }

  /// The saved tensors by name; accumulate until clear().
  const SavedTensors& view() const;
  void clear();

 private:
  struct Kept {
    Slot slot;
    std::optional<int64_t> step;
    torch::Tensor value;
  };
  /// The view's list of (slot, step), found or made once.
  std::vector<torch::Tensor>& list_of(Slot slot, std::optional<int64_t> step) const;

  std::vector<std::string> names_;  ///< by slot
  std::unordered_map<std::string, Slot> slots_;
  std::optional<int64_t> step_;
  std::optional<int64_t> rows_;
  std::vector<std::pair<Slot, torch::Tensor>>* redirect_ = nullptr;
  mutable std::vector<Kept> pending_;  ///< kept since the view was last built
  mutable SavedTensors view_;
  /// [slot][step + 1] → view_'s list (nullptr: not named yet); map nodes stay where they are.
  mutable std::vector<std::vector<std::vector<torch::Tensor>*>> lists_;
};

}  // namespace frag::program
