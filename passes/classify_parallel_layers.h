//===- passes/classify_parallel_layers.h - Find what is sharded --*- C++ -*-===//
//
// Walks a module tree and, for every module whose class is a known parallel
// layer, reads the config attributes the export kit keeps (tp_size,
// gather_output, output_sizes, head counts, …) and decides for each side
// whether it is fragmented and by which fragment rule (ir/fragment_rule.h).
// The decision depends on the layer's type and config only, never on the rank.
//
// One classification serves both formats: a TorchScript module is first
// described (ir::ModuleDescription: path, class, attributes, parameter shapes);
// a torch.export archive is described from its graph's nn_module_stack and the
// configs the kit recorded (runtime/pt2_archive.h).
//
// TorchScript keeps no class hierarchy, so a layer is known by its class name
// with `___torch_mangle_N` segments stripped; a user rules file can declare
// more class names as a kind of a known layer:
//     {"layers": {"MyFancyQKV": "QKVParallelLinear"}}
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/fragment_table.h"
#include "ir/module_description.h"

#include <torch/csrc/jit/api/module.h>

#include <map>
#include <string>
#include <vector>

namespace frag::passes {

/// Class names a user declares as a kind of a known layer.
struct LayerAliases {
  std::map<std::string, std::string> kind_of_class;
  std::string source;  ///< the rules file, named in errors about the classes it declares

  /// Reads a rules file; bad JSON or an unknown kind: frag::Error naming the file.
  static LayerAliases from_file(const std::string& path);
};

/// The layer kinds the pass knows (vLLM's class names).
const std::vector<std::string>& known_layer_kinds();

/// "__torch__.fragkit.layers.___torch_mangle_3.QKVParallelLinear" -> "QKVParallelLinear".
std::string plain_class_name(const std::string& qualified_name);

/// Classifies every parallel layer under `root`. `source` (a file name) is
/// used in errors: a missing config attribute or inconsistent sizes name the
/// file, the module path and the problem.
ir::FragmentTable classify_parallel_layers(const torch::jit::Module& root,
                                           const LayerAliases& aliases, const std::string& source);

/// The same on described modules, in the order given (pre-order, as
/// named_modules). A known layer without config (`has_config` false) is a
/// frag::Error naming the file, the layer and where the config was expected.
ir::FragmentTable classify_parallel_layers(const std::vector<ir::ModuleDescription>& modules,
                                           const LayerAliases& aliases, const std::string& source);

/// The modules of `root` that are known layers (aliases included), described
/// with every non-module attribute and the shapes of their tensors.
std::vector<ir::ModuleDescription> describe_modules(const torch::jit::Module& root, const LayerAliases& aliases);

/// Checks that several rank files' tables agree (rank order as given); a
/// difference is a frag::Error naming both files and the first differing layer.
void check_tables_agree(const std::vector<std::string>& sources,
                        const std::vector<ir::FragmentTable>& tables);

}  // namespace frag::passes
