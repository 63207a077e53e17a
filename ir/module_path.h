//===- ir/module_path.h - Submodules by dotted path ----------*- C++ -*-===//
//
// Locations, layer entries and ad-hoc calls name a submodule by its dotted
// path from the root ("model.layers.0.mlp.down_proj"), as named_modules()
// does. The rewrite resolves the module a call site reaches; the call wrappers
// (runtime/ad_hoc_call) resolve the module a user names.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <torch/script.h>

#include <cstdint>
#include <map>
#include <string>

namespace frag::ir {

/// The submodule of `root` at the dotted `path`; `root` itself for "".
/// Throws frag::Error naming the first part of `path` that is not a submodule.
torch::jit::Module module_at(const torch::jit::Module& root, const std::string& path);

/// The integer attributes of the submodule at `path` (a layer's layout config:
/// head_size, total_num_heads, …); empty where `path` is no submodule.
std::map<std::string, int64_t> int_attributes_at(const torch::jit::Module& root, const std::string& path);

}  // namespace frag::ir
