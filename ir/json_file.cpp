//===- ir/json_file.cpp - A JSON file, read with errors that name it -----===//
#include "ir/json_file.h"

#include "ir/error.h"

#include <fstream>

namespace frag::ir {

nlohmann::json read_json_file(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  if (!in) fail("{}: cannot open the {}", path, what);
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    fail("{}: {} is not valid JSON: {}", path, what, e.what());
  }
}

}  // namespace frag::ir
