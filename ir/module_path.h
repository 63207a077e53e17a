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

#include <string>

namespace frag::ir {

/// The submodule of `root` at the dotted `path`; `root` itself for "".
/// Throws frag::Error naming the first part of `path` that is not a submodule.
torch::jit::Module module_at(const torch::jit::Module& root, const std::string& path);

}  // namespace frag::ir
