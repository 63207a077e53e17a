//===- tests/support/inspect_json.cpp - frag inspect --json in tests -----===//
#include "tests/support/inspect_json.h"

#include "tests/support/test_support.h"

#include <gtest/gtest.h>

namespace frag::testing {

nlohmann::json inspect_json(std::vector<std::string> args) {
  args.insert(args.begin(), "inspect");
  args.push_back("--json");
  auto result = frag(args);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(result.err, "");
  try {
    return nlohmann::json::parse(result.out);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "inspect --json printed no JSON document: " << e.what() << "\n" << result.out;
    return nlohmann::json::object();
  }
}

}  // namespace frag::testing
