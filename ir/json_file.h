//===- ir/json_file.h - A JSON file, read with errors that name it -*- C++ -*-===//
//
// Plans and rules files are JSON written by people: a missing file or a syntax
// error is one message naming the file and what it was meant to be.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace frag::ir {

/// Parses the JSON file at `path`; `what` ("plan", "rules file") names it in
/// errors. Missing, unreadable or not JSON: frag::Error.
nlohmann::json read_json_file(const std::string& path, const std::string& what);

}  // namespace frag::ir
