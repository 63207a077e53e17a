//===- tests/support/inspect_json.h - frag inspect --json in tests -*- C++ -*-===//
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace frag::testing {

/// Runs `frag inspect ARGS... --json` and parses its report; a failed run or a
/// report that is not JSON is a test failure (and an empty object).
nlohmann::json inspect_json(std::vector<std::string> args);

}  // namespace frag::testing
