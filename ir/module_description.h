//===- ir/module_description.h - A module as the classification sees it -*- C++ -*-===//
//
// What classify_parallel_layers needs to know of one module, whatever the file
// format: its path, its class and its layout config. A TorchScript module
// keeps the config as attributes; a torch.export archive (.pt2) keeps no
// attributes, so the export kit records them beside the graph and the archive
// reader (runtime/pt2_archive.h) fills this from that record. Both give
// the classification the same values, so both formats get the same rules.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace frag::ir {

/// One module instance of a model.
struct ModuleDescription {
  std::string path;        ///< dotted path from the root, "" for the root
  std::string class_name;  ///< as the file names it (qualified or plain)
  /// Config values by attribute name: int, bool or List[int] for well-formed
  /// files (anything else is kept with its own type, for the error message).
  std::map<std::string, c10::IValue> attributes;
  /// Shapes of the module's own parameters, by name.
  std::map<std::string, std::vector<int64_t>> parameter_shapes;
  /// False where the file names the module but records no config for it (a
  /// .pt2 archive whose layer was not recorded): a known layer kind is refused.
  bool has_config = true;
  /// Where the config should have been, for that refusal ("extra/fragkit.json").
  std::string config_origin;
};

}  // namespace frag::ir
