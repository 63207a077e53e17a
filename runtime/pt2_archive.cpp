//===- runtime/pt2_archive.cpp - One rank's torch.export archive ----===//
#include "runtime/pt2_archive.h"

#include "ir/error.h"
#include "ir/module_path.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/utils/generated_serialization_types.h>

#include <map>
#include <memory>
#include <set>

namespace frag::runtime {
namespace {

constexpr const char* kModelRecord = "models/model.json";
constexpr const char* kExtraInfoRecord = "extra/fragkit.json";

std::unique_ptr<caffe2::serialize::PyTorchStreamReader> open_archive(const std::string& path) {
  try {
    return std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
  } catch (const c10::Error& e) {
    fail("{}: not a torch.export archive (expected a .pt2 zip written by torch.export.save): {}", path,
         e.what_without_backtrace());
  }
}

std::string record(caffe2::serialize::PyTorchStreamReader& reader, const std::string& path, const std::string& name) {
  if (!reader.hasRecord(name)) fail("{}: the archive has no {} (expected one in a torch.export archive)", path, name);
  try {
    auto [data, size] = reader.getRecord(name);
    return std::string(static_cast<const char*>(data.get()), size);
  } catch (const c10::Error& e) {
    fail("{}: cannot read {}: {}", path, name, e.what_without_backtrace());
  }
}

nlohmann::json parse_json(const std::string& text, const std::string& path, const std::string& name) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: {} is not JSON: {}", path, name, e.what());
  }
}

/// path -> class of every module some node of the graph runs in, in first-seen order.
std::vector<std::pair<std::string, std::string>> module_tree(const torch::_export::ExportedProgram& program,
                                                            const std::string& path) {
  std::vector<std::pair<std::string, std::string>> modules;
  std::map<std::string, std::string> class_of;
  for (const auto& node : program.get_graph_module().get_graph().get_nodes()) {
    const auto& metadata = node.get_metadata();
    auto found = metadata.find("nn_module_stack");
    if (found == metadata.end()) continue;
    const std::string& stack = found->second;
    size_t start = 0;
    while (start <= stack.size()) {
      size_t end = stack.find(';', start);
      if (end == std::string::npos) end = stack.size();
      const auto parts = ir::split_stack_entry(stack.substr(start, end - start));
      if (parts.size() != 3)
        fail("{}: node '{}': nn_module_stack entry '{}' has {} fields, expected 3 (key,path,class)", path,
             node.get_name().value_or("?"), stack.substr(start, end - start), parts.size());
      const auto& [it, added] = class_of.emplace(parts[1], parts[2]);
      if (added) modules.emplace_back(parts[1], parts[2]);
      else if (it->second != parts[2])
        fail("{}: module '{}' is a {} in one node's nn_module_stack and a {} in another's", path, parts[1],
             it->second, parts[2]);
      start = end + 1;
    }
  }
  return modules;
}

/// A recorded config value as the classification reads attributes: int, bool, List[int]; others keep their type.
c10::IValue config_value(const nlohmann::json& value) {
  if (value.is_boolean()) return value.get<bool>();
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number_float()) return value.get<double>();
  if (value.is_array()) {
    std::vector<int64_t> ints;
    for (const auto& v : value) {
      if (!v.is_number_integer()) return value.dump();  // reported as a string where a list was expected
      ints.push_back(v.get<int64_t>());
    }
    return ints;
  }
  return value.dump();
}

/// fragkit.json's "kv_cache": four positive integers.
KvCacheRecord kv_cache_record(const nlohmann::json& record, const std::string& path) {
  KvCacheRecord out;
  const std::pair<const char*, int64_t*> fields[] = {{"layers", &out.layers},
                                                     {"kv_heads", &out.kv_heads},
                                                     {"head_size", &out.head_size},
                                                     {"max_positions", &out.max_positions}};
  for (const auto& [name, field] : fields) {
    if (!record.contains(name) || !record.at(name).is_number_integer() || record.at(name).get<int64_t>() < 1)
      fail("{}: {} \"kv_cache\": expected a positive integer \"{}\", found {}", path, kExtraInfoRecord, name,
           record.contains(name) ? record.at(name).dump() : "none");
    *field = record.at(name).get<int64_t>();
  }
  return out;
}

}  // namespace

ExportedProgram read_exported_program(const std::string& path) {
  auto reader = open_archive(path);
  ExportedProgram program;
  program.path = path;
  const std::string format = record(*reader, path, "archive_format");
  if (format != "pt2") fail("{}: archive_format is '{}', expected 'pt2' (a torch.export archive)", path, format);
  program.model = parse_json(record(*reader, path, kModelRecord), path, kModelRecord);
  if (!reader->hasRecord(kExtraInfoRecord))
    fail("{}: no {} in the archive: expected the kit's record of the export and of each parallel layer's "
         "config, found none (export with fragkit.export.export(..., format=\"export\"))",
         path, kExtraInfoRecord);
  const nlohmann::json info = parse_json(record(*reader, path, kExtraInfoRecord), path, kExtraInfoRecord);
  if (const std::string table = std::string("extra/") + kRuleTableFile; reader->hasRecord(table))
    program.rule_table = record(*reader, path, table);
  try {
    const auto& version = program.model.at("schema_version");
    program.schema_major = version.at("major").get<int64_t>();
    program.schema_minor = version.at("minor").get<int64_t>();
    if (program.schema_major != kSchemaMajor)
      fail("{}: {} has schema version {}.{}; this build reads schema major {} (torch.export of PyTorch 2.11)",
           path, kModelRecord, program.schema_major, program.schema_minor, kSchemaMajor);
    program.info.export_id = info.value("export_id", "");
    program.info.tp_size = info.at("tp_size").get<int64_t>();
    program.info.tp_rank = info.at("tp_rank").get<int64_t>();
    program.info.model = info.value("model", "");
    if (info.contains("kv_cache")) program.kv_cache = kv_cache_record(info.at("kv_cache"), path);

    // Typed once the version is known to be one this build's schema (PyTorch's generated types) reads.
    torch::_export::ExportedProgram typed;
    try {
      typed = program.model.get<torch::_export::ExportedProgram>();
    } catch (const nlohmann::json::exception&) {
      throw;
    } catch (const std::exception& e) {  // the generated types throw their own for unknown union tags
      fail("{}: {} does not follow schema {}.{}: {}", path, kModelRecord, program.schema_major,
           program.schema_minor, e.what());
    }
    const auto tree = module_tree(typed, path);
    std::map<std::string, std::string> class_of(tree.begin(), tree.end());
    std::set<std::string> recorded;
    if (info.value("layers_format", "") != kLayersFormat)
      fail("{}: {} has no layer configs (layers_format '{}', expected '{}'); export with "
           "fragkit.export.export(..., format=\"export\")",
           path, kExtraInfoRecord, info.value("layers_format", ""), kLayersFormat);
    for (const auto& layer : info.at("layers")) {
      ir::ModuleDescription module;
      module.path = layer.at("path").get<std::string>();
      module.class_name = layer.at("class").get<std::string>();
      module.config_origin = kExtraInfoRecord;
      auto in_graph = class_of.find(module.path);
      if (in_graph != class_of.end() && in_graph->second.substr(in_graph->second.rfind('.') + 1) != module.class_name)
        fail("{}: {} records {} as a {}, but the graph's nn_module_stack has a {}", path, kExtraInfoRecord,
             module.path, module.class_name, in_graph->second);
      for (const auto& [name, value] : layer.at("config").items()) module.attributes[name] = config_value(value);
      const nlohmann::json parameters = layer.value("parameters", nlohmann::json::object());  // kept alive
      for (const auto& [name, shape] : parameters.items())
        module.parameter_shapes[name] = shape.get<std::vector<int64_t>>();
      if (!recorded.insert(module.path).second) fail("{}: {} records {} twice", path, kExtraInfoRecord, module.path);
      program.modules.push_back(std::move(module));
    }
    for (const auto& [module_path, class_name] : tree) {
      if (recorded.count(module_path)) continue;
      ir::ModuleDescription module;
      module.path = module_path;
      module.class_name = class_name;
      module.has_config = false;
      module.config_origin = kExtraInfoRecord;
      program.modules.push_back(std::move(module));
    }
  } catch (const nlohmann::json::exception& e) {
    fail("{}: malformed {} or {}: {}", path, kModelRecord, kExtraInfoRecord, e.what());
  }
  return program;
}

std::string rewritten_archive(const std::string& path, const nlohmann::json& model,
                              const std::map<std::string, std::string>& extra) {
  auto reader = open_archive(path);
  std::string bytes;
  caffe2::serialize::PyTorchStreamWriter writer(
      [&](const void* data, size_t size) {
        bytes.append(static_cast<const char*>(data), size);
        return size;
      },
      /*compute_crc32=*/true);
  // torch.export.save's zip format version (PT2ArchiveWriter.set_min_version).
  writer.setMinVersion(6);
  // Records the writer makes itself, at the end.
  const std::set<std::string> own = {".data/version", ".data/serialization_id", "byteorder", "version"};
  std::set<std::string> replaced = {kModelRecord};
  for (const auto& [name, contents] : extra) replaced.insert("extra/" + name);
  try {
    for (const auto& name : reader->getAllRecords()) {
      if (own.count(name) || replaced.count(name)) continue;
      auto [data, size] = reader->getRecord(name);
      writer.writeRecord(name, data.get(), size);
    }
    const std::string text = model.dump();
    writer.writeRecord(kModelRecord, text.data(), text.size());
    for (const auto& [name, contents] : extra) writer.writeRecord("extra/" + name, contents.data(), contents.size());
    writer.writeEndOfFile();
  } catch (const c10::Error& e) {
    fail("{}: cannot copy the archive: {}", path, e.what_without_backtrace());
  }
  return bytes;
}

}  // namespace frag::runtime
