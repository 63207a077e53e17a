//===- runtime/pt2_archive.h - One rank's torch.export archive -*- C++ -*-===//
//
// Reads a .pt2 archive (torch.export.save: a zip written by PyTorch's stream
// writer, read here with LibTorch's PyTorchStreamReader): the graph
// (models/model.json, schema major kSchemaMajor), the module tree its nodes
// name (metadata "nn_module_stack": "key,path,class;…"), and the kit's
// extra/fragkit.json (export id, tp, and each parallel layer's config, which an
// exported program keeps nowhere else). The result describes the modules as
// the classification wants them (ir::ModuleDescription), so .pt2 and
// TorchScript files go through one classification.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/module_description.h"
#include "runtime/rank_module.h"

#include <nlohmann/json.hpp>

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace frag::runtime {

/// The models/model.json schema major version this build reads (PyTorch 2.11 writes 8.x).
inline constexpr int64_t kSchemaMajor = 8;
/// The kit's record of layer configs in extra/fragkit.json.
inline constexpr const char* kLayersFormat = "fragkit.layers/1";

/// This rank's KV cache as a cached export records it (extra/fragkit.json "kv_cache", written by
/// fragkit.export with kv_cache=True): the forward is forward(input_ids, positions, kv_cache, cache_len)
/// over a cache [layers, 2, rows, kv_heads, slots, head_size].
struct KvCacheRecord {
  int64_t layers = 0, kv_heads = 0, head_size = 0, max_positions = 0;
};

/// One rank's archive, read.
struct ExportedProgram {
  std::string path;
  ExportInfo info;
  int64_t schema_major = 0, schema_minor = 0;
  /// Every module the graph names and every recorded layer: recorded layers
  /// first, in the kit's order (named_modules), then the others.
  std::vector<ir::ModuleDescription> modules;
  /// The graph document (models/model.json) as read.
  nlohmann::json model;
  /// The rule table frag rewrite embedded (extra/ + kRuleTableFile), "" in an original export.
  std::string rule_table;
  /// Where the forward takes a KV cache; archives exported without one (and before) have none.
  std::optional<KvCacheRecord> kv_cache;
};

/// Reads `path`. Not an archive, another schema major, a malformed graph or
/// record: frag::Error naming the file, what was expected and what was found.
ExportedProgram read_exported_program(const std::string& path);

/// A copy of the archive at `path` (read before) with models/model.json replaced by `model` and each
/// `extra` record (name -> contents) added under extra/; every other record is copied byte for byte.
/// Returned as bytes: the caller writes them atomically. Fails naming the file.
std::string rewritten_archive(const std::string& path, const nlohmann::json& model,
                              const std::map<std::string, std::string>& extra);

}  // namespace frag::runtime
