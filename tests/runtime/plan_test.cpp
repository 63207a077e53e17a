//===- tests/runtime/plan_test.cpp - Plans parse once into typed steps ===//
//
// A plan's text becomes typed steps at parse time: enum actions, parsed
// indices, values loaded. Names and visits are validated there, and the
// text ranks compare describes a value by its bytes, not its path.
//
//===----------------------------------------------------------------------===//
#include "runtime/plan.h"

#include "ir/error.h"
#include "runtime/safetensors.h"
#include "tests/support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace frag::runtime {
namespace {

using ::testing::HasSubstr;

Plan parse(const nlohmann::json& steps, const std::string& base = "") {
  return Plan::from_json(steps, "plan.json", base);
}

std::string parse_error(const nlohmann::json& steps) {
  try {
    parse(steps);
  } catch (const Error& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(Plan, ActionsAreTypedOnce) {
  const auto plan = parse(nlohmann::json::array({{{"at", "a.output"}, {"do", "save"}, {"as", "x"}},
                                                 {{"at", "a.output"}, {"do", "scale"}, {"by", 0.5}},
                                                 {{"at", "a.output"}, {"do", "zero"}, {"index", "...,0:2"}},
                                                 {{"at", "a.output"}, {"do", "call"}, {"as", "y"}, {"modules", {"m"}}}}));
  ASSERT_EQ(plan.steps.size(), 4u);
  EXPECT_EQ(plan.steps[0].action, Action::kSave);
  EXPECT_EQ(plan.steps[1].action, Action::kScale);
  EXPECT_EQ(plan.steps[2].action, Action::kZero);
  EXPECT_EQ(plan.steps[3].action, Action::kCall);
  EXPECT_FALSE(edits(Action::kSave));
  EXPECT_TRUE(edits(Action::kZero));
  EXPECT_STREQ(action_name(Action::kScale), "scale");
  ASSERT_TRUE(plan.steps[2].index.has_value());
  EXPECT_EQ(plan.steps[2].index->items.size(), 2u);
}

TEST(Plan, NamesAndVisitsAreValidatedAtParse) {
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "save"}, {"as", "logits"}}}),
              HasSubstr("\"logits\" is reserved"));
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "save"}, {"as", "__metadata__"}}}), HasSubstr("reserved"));
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "save"}, {"as", "x"}},
                           {{"at", "b.output"}, {"do", "save"}, {"as", "x"}}}),
              HasSubstr("intervention 1: \"as\": \"x\" is already saved by an earlier step"));
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "save"}}}),
              HasSubstr("intervention 0: \"save\" needs \"as\""));
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "save"}, {"as", ""}}}), HasSubstr("\"as\" is empty"));
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "zero"}, {"visit", 1.5}}}),
              HasSubstr("\"visit\" must be a whole number of calls (0 for the first), got 1.5"));
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "zero"}, {"visit", -2}}}),
              HasSubstr("\"visit\" must be non-negative, got -2"));
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "zero"}, {"visit", 18446744073709551615ull}}}),
              HasSubstr("must be a whole number"));
}

TEST(Plan, MissingAndMistypedFieldsAreNamedInTheUsersWords) {
  // Not the JSON library's "key 'at' not found" / "type must be string, but is number".
  EXPECT_THAT(parse_error({{{"location", "a.output"}, {"action", "save"}}}),
              HasSubstr("intervention 0: needs \"at\" (the location, e.g. \"model.layers.0.mlp.output\"); it has "
                        "the fields \"action\", \"location\""));
  EXPECT_THAT(parse_error({{{"at", "a.output"}}}), HasSubstr("needs \"do\" (the action: save, set, add"));
  EXPECT_THAT(parse_error({{{"at", 3}, {"do", "zero"}}}), HasSubstr("intervention 0: \"at\" must be a string, got 3"));
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "scale"}, {"by", "2"}}}),
              HasSubstr("\"by\" must be a number, got \"2\""));
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "call"}, {"as", "y"}, {"modules", "m"}}}),
              HasSubstr("\"modules\" must be a list of module paths (strings), got \"m\""));
}

TEST(Plan, ControlCharactersNeitherTruncateMessagesNorBecomeNames) {
  // A NUL byte used to end the message where what() was printed; names with one were written as keys.
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "save"}, {"as", std::string("x\0y", 3)}}}),
              HasSubstr("\"as\": \"x\\x00y\" holds a control character; a saved name must be printable"));
  EXPECT_EQ(std::string(Error(std::string("before\0after\x01", 13)).what()), "before\\x00after\\x01");
}

TEST(Plan, RanksCompareValuesByTheirBytesNotTheirPaths) {
  const auto one = testing::temporary_folder();
  const auto two = testing::temporary_folder();
  write_safetensors(one + "/v.safetensors", {{"v", torch::ones({4})}});
  write_safetensors(two + "/v.safetensors", {{"v", torch::ones({4})}});
  const nlohmann::json steps = {{{"at", "a.output"}, {"do", "add"}, {"value", "v.safetensors:v"}}};
  const auto a = parse(steps, one).steps.at(0).describe();
  EXPECT_EQ(a, parse(steps, two).steps.at(0).describe()) << "same bytes, other folder: the same step";
  write_safetensors(two + "/v.safetensors", {{"v", torch::full({4}, 2.0)}});
  EXPECT_NE(a, parse(steps, two).steps.at(0).describe()) << "same path, other bytes: another step";
  write_safetensors(two + "/v.safetensors", {{"v", torch::ones({2, 2})}});
  EXPECT_NE(a, parse(steps, two).steps.at(0).describe()) << "same bytes, other shape: another step";
}

/// A safetensors file with the given header and `data` bytes after it.
std::string safetensors_with_header(const std::string& header, size_t data = 0) {
  const std::string path = testing::temporary_folder() + "/x.safetensors";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  testing::write_text(path, bytes + header + std::string(data, '\0'));
  return path;
}

std::string read_error(const std::string& path) {
  try {
    read_safetensors(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(Safetensors, HostileShapesAreErrorsNotAllocations) {
  // Found by tests/fuzz/safetensors_fuzzer: shapes were allocated before they were checked.
  EXPECT_THAT(read_error(safetensors_with_header(R"({"v":{"dtype":"F32","shape":[-4],"data_offsets":[0,0]}})")),
              HasSubstr("tensor 'v' has a negative dimension -4"));
  EXPECT_THAT(read_error(safetensors_with_header(
                  R"({"v":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,0]}})")),
              HasSubstr("tensor 'v' has a shape whose size overflows"));
  EXPECT_THAT(read_error(safetensors_with_header(R"({"v":{"dtype":"F32","shape":[1000000000000],"data_offsets":[0,16]}})", 16)),
              HasSubstr("data offsets that do not fit"));
  // An empty tensor is fine.
  const auto empty = read_safetensors(safetensors_with_header(R"({"e":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})"));
  ASSERT_EQ(empty.count("e"), 1u);
  EXPECT_EQ(empty.at("e").numel(), 0);
}

}  // namespace
}  // namespace frag::runtime
