//===- ir/module_path.h - Submodules by dotted path ----------*- C++ -*-===//
//
// Locations, layer entries and ad-hoc calls name a submodule by its dotted
// path from the root ("model.layers.0.mlp.down_proj"), as named_modules()
// does. The rewrite resolves the module a call site reaches; the call wrappers
// (runtime/ad_hoc_call) resolve the module a user names. A torch.export graph
// names the modules a node runs in by their paths too (nn_module_stack).
//
//===----------------------------------------------------------------------===//
#pragma once

#include <torch/csrc/jit/api/module.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace frag::ir {

/// The submodule of `root` at the dotted `path`; `root` itself for "".
/// Throws frag::Error naming the first part of `path` that is not a submodule.
torch::jit::Module module_at(const torch::jit::Module& root, const std::string& path);

/// The dotted path of `parent`'s submodule `name` ("" is the root).
std::string child_path(const std::string& parent, const std::string& name);

/// The integer attributes of the submodule at `path` (a layer's layout config:
/// head_size, total_num_heads, …); empty where `path` is no submodule.
std::map<std::string, int64_t> int_attributes_at(const torch::jit::Module& root, const std::string& path);

/// One "key,path,class" entry of a torch.export node's nn_module_stack, split as
/// torch/_export/serde/serialize.py splits it: at commas outside brackets and parentheses. A well-formed
/// entry gives three parts; the path is the second ("" for the root).
std::vector<std::string> split_stack_entry(const std::string& entry);

}  // namespace frag::ir
