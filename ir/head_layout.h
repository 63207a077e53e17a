//===- ir/head_layout.h - Attention heads on a location's last dim -*- C++ -*-===//
//
// Where a location's value is laid out in attention heads, its last dim (in
// whole coordinates) splits into named regions of equal-width heads:
//   - a QKVParallelLinear's output: segments "q", "k", "v" in that order,
//     q of total_num_heads × head_size, k of total_num_kv_heads × head_size,
//     v of total_num_kv_heads × v_head_size;
//   - the input of a RowParallelLinear beside one (o_proj next to qkv_proj in
//     one attention module): "heads", total_num_heads × v_head_size wide.
// The one source of these numbers for JSON plans, frag inspect and the Python
// API's head views (python/fragments/local/model.py, Model._head_layout, through
// _C's ShardedModel.head_layout).
// A layer's kind is the table's (its class, or the class --rules declares it as).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/fragment_table.h"

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace frag::ir {

/// One region of the last dim: [start, stop) in whole coordinates, head_dim wide heads.
struct HeadRegion {
  std::string name;  ///< "q", "k", "v" or "heads"
  int64_t start = 0, stop = 0, head_dim = 0;
  int64_t heads() const { return (stop - start) / head_dim; }
  bool operator==(const HeadRegion& o) const {
    return name == o.name && start == o.start && stop == o.stop && head_dim == o.head_dim;
  }
};

/// The regions of a location, in last-dim order; empty where it has no heads.
using HeadLayout = std::vector<HeadRegion>;

/// A module's integer config attributes by name (head_size, total_num_heads, …).
using IntAttributes = std::map<std::string, int64_t>;

/// q/k/v of a QKV layer's output from its attributes; empty if one is missing or not positive.
HeadLayout qkv_output_heads(const IntAttributes& qkv);
/// "heads" of the attention output projection's input, from the QKV layer's attributes.
HeadLayout attention_output_heads(const IntAttributes& qkv);

/// The head layout of `location` ("<path>.input"/"<path>.output") of a model
/// whose layers `table` lists; `attributes(path)` gives a module's integer attributes.
HeadLayout head_layout(const FragmentTable& table, const std::string& location,
                       const std::function<IntAttributes(const std::string& path)>& attributes);

}  // namespace frag::ir
