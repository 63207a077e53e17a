//===- ir/module_path.cpp - Submodules by dotted path ----------------===//
#include "ir/module_path.h"

#include "ir/error.h"

namespace frag::ir {

torch::jit::Module module_at(const torch::jit::Module& root, const std::string& path) {
  torch::jit::Module module = root;
  size_t start = 0;
  while (start < path.size()) {
    size_t end = path.find('.', start);
    if (end == std::string::npos) end = path.size();
    const std::string name = path.substr(start, end - start);
    if (!module.hasattr(name) || !module.attr(name).isModule())
      fail("unknown module '{}' ('{}' is not a submodule of '{}')", path, name, path.substr(0, start ? start - 1 : 0));
    module = module.attr(name).toModule();
    start = end + 1;
  }
  return module;
}

std::map<std::string, int64_t> int_attributes_at(const torch::jit::Module& root, const std::string& path) {
  std::map<std::string, int64_t> out;
  try {
    for (const auto& attribute : module_at(root, path).named_attributes(/*recurse=*/false))
      if (attribute.value.isInt()) out[attribute.name] = attribute.value.toInt();
  } catch (const Error&) {
    out.clear();  // no submodule there: no config
  }
  return out;
}

std::string child_path(const std::string& parent, const std::string& name) {
  return parent.empty() ? name : parent + "." + name;
}

std::vector<std::string> split_stack_entry(const std::string& entry) {
  std::vector<std::string> parts;
  size_t start = 0;
  int depth = 0;
  for (size_t i = 0; i < entry.size(); ++i) {
    const char c = entry[i];
    if (c == '[' || c == '(') ++depth;
    else if (c == ']' || c == ')') --depth;
    else if (c == ',' && depth == 0) {
      parts.push_back(entry.substr(start, i - start));
      start = i + 1;
    }
  }
  parts.push_back(entry.substr(start));
  return parts;
}

}  // namespace frag::ir
