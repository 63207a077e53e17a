//===- tests/runtime/plan_test.cpp - Plans parse once into typed steps ===//
//
// A plan's text becomes typed steps at parse time: enum actions, parsed
// indices, values loaded. Names and visits are validated there, and the
// text ranks compare describes a value by its bytes, not its path. The
// format is fragments.plan/1 (runtime/plan.schema.json; the parser's tables
// are compared with it here, every plan of the repository in plan_schema_test.py).
//
//===----------------------------------------------------------------------===//
#include "runtime/plan.h"

#include "ir/error.h"
#include "runtime/safetensors.h"
#include "tests/support/test_support.h"

#include <filesystem>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace frag::runtime {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

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
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "save"}, {"as", ""}}}),
              HasSubstr("intervention 0: \"as\" is empty: expected the name to save under"));
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

TEST(Plan, EmptyValuesNameTheirFieldAndStep) {
  // Issue 16: "at": "" was reported as "unknown location ''" without the field, "value": "" ran the forward
  // without a value (a LibTorch error), "index": "" gave "index '': empty component" without the file or step.
  const nlohmann::json save = {{"at", "a.output"}, {"do", "save"}, {"as", "x"}};
  EXPECT_EQ(parse_error({save, {{"at", ""}, {"do", "zero"}}}),
            "plan.json: intervention 1: \"at\" is empty: expected a location such as \"model.layers.0.mlp.output\" "
            "(frag inspect --all lists them)");
  EXPECT_EQ(parse_error({{{"at", "a.output"}, {"do", ""}}}),
            "plan.json: intervention 0: \"do\" is empty: expected one of save, set, add, scale, zero, call");
  EXPECT_EQ(parse_error({{{"at", "a.output"}, {"do", "add"}, {"value", ""}}}),
            "plan.json: intervention 0: \"value\" is empty: expected \"file.safetensors:tensor\"");
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "add"}, {"value", "v.safetensors:"}}}),
              HasSubstr("intervention 0: \"value\" must be \"file.safetensors:tensor\", got \"v.safetensors:\" (no "
                        "tensor name after ':')"));
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "add"}, {"value", ":v"}}}), HasSubstr("(no file before ':')"));
  EXPECT_EQ(parse_error({{{"at", "a.output"}, {"do", "zero"}, {"index", ""}}}),
            "plan.json: intervention 0: \"index\" is empty: expected a numpy-style index of the whole tensor such as "
            "\"...,0:8\"");
  EXPECT_EQ(parse_error({{{"at", "a.output"}, {"do", "zero"}, {"index", "0:x"}}}),
            "plan.json: intervention 0: \"index\": index '0:x': 'x' is not an integer");
  EXPECT_EQ(parse_error({{{"at", "a.output"}, {"do", "call"}, {"as", "y"}, {"modules", nlohmann::json::array({"model.norm", ""})}}}),
            "plan.json: intervention 0: \"modules\": entry 1 is empty: expected a module path such as \"model.norm\"");
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "call"}, {"as", "y"}, {"modules", nlohmann::json::array()}}}),
              HasSubstr("intervention 0: \"modules\" is empty: expected the module paths to call"));
}

TEST(Plan, MisspeltFieldsAndActionsGetADidYouMean) {
  // Issue 16: "unknown field \"actoin\"" said neither which field was meant nor which exist.
  EXPECT_EQ(parse_error({{{"at", "a.output"}, {"do", "zero"}, {"vist", 1}}}),
            "plan.json: intervention 0: unknown field \"vist\" (did you mean \"visit\"?); a step's fields are at, do, "
            "as, value, by, index, segment, heads, visit, modules, steps, rows");
  // The words a user may write for a field, and their typos, point at the field's name.
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "zero"}, {"actoin", "zero"}}}),
              HasSubstr("unknown field \"actoin\" (did you mean \"do\"?)"));
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "zero"}, {"lcoation", "b.output"}}}),
              HasSubstr("unknown field \"lcoation\" (did you mean \"at\"?)"));
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "save"}, {"as", "x"}, {"name", "y"}}}),
              HasSubstr("unknown field \"name\" (did you mean \"as\"?)"));
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "zero"}, {"colour", 1}}}),
              HasSubstr("unknown field \"colour\"; a step's fields are")) << "nothing close: no guess";
  EXPECT_EQ(parse_error({{{"at", "a.output"}, {"do", "scal"}, {"by", 2}}}),
            "plan.json: intervention 0: unknown action \"scal\" (did you mean \"scale\"?); expected one of save, set, "
            "add, scale, zero, call");
  EXPECT_EQ(parse_error({{"intervention", nlohmann::json::array()}}),
            "plan.json: a plan needs \"interventions\": [...] (found \"intervention\"; did you mean \"interventions\"?)");
}

TEST(Plan, ControlCharactersNeitherTruncateMessagesNorBecomeNames) {
  // A NUL byte used to end the message where what() was printed; names with one were written as keys.
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "save"}, {"as", std::string("x\0y", 3)}}}),
              HasSubstr("\"as\": \"x\\x00y\" holds a control character; a saved name must be printable"));
  EXPECT_EQ(std::string(Error(std::string("before\0after\x01", 13)).what()), "before\\x00after\\x01");
}

TEST(Plan, OneVersionedFormat) {
  // fragments.plan/1: a "format" naming it, none, or a bare list of steps; another version refused in words.
  const nlohmann::json steps = nlohmann::json::array({{{"at", "a.output"}, {"do", "save"}, {"as", "x"}}});
  EXPECT_EQ(parse({{"format", "fragments.plan/1"}, {"interventions", steps}}).steps.size(), 1u);
  EXPECT_EQ(parse({{"interventions", steps}}).steps.size(), 1u);
  EXPECT_EQ(parse(steps).steps.size(), 1u);
  EXPECT_EQ(parse_error({{"format", "fragments.plan/2"}, {"interventions", steps}}),
            "plan.json: plan format is \"fragments.plan/2\", expected \"fragments.plan/1\" (this build reads that "
            "version only)");
  EXPECT_EQ(parse_error({{"format", 1}, {"interventions", steps}}),
            "plan.json: \"format\" must be a string such as \"fragments.plan/1\", got 1");
  EXPECT_EQ(parse_error({{"fromat", "fragments.plan/1"}, {"interventions", steps}}),
            "plan.json: unknown plan field \"fromat\" (did you mean \"format\"?); a plan has \"format\" and "
            "\"interventions\"");
  EXPECT_THAT(parse_error(3), HasSubstr("plan.json: a plan is {\"format\": \"fragments.plan/1\", \"interventions\""));
}

TEST(Plan, TheParserReadsTheSchemasFieldsAndActions) {
  // runtime/plan.schema.json defines the format; the parser's tables are its, in its order.
  std::string path = frag::testing::data_path("runtime/plan.schema.json");
#ifdef FRAG_SOURCE_DIR
  if (!std::filesystem::exists(path)) path = std::string(FRAG_SOURCE_DIR) + "/runtime/plan.schema.json";  // CMake
#endif
  const auto schema = nlohmann::ordered_json::parse(frag::testing::read_text(path));
  const auto& defs = schema.at("$defs");
  std::vector<std::string> fields;
  for (const auto& [key, _] : defs.at("step_fields").at("properties").items()) fields.push_back(key);
  EXPECT_EQ(fields, plan_step_fields());
  EXPECT_EQ(defs.at("step_fields").at("properties").at("do").at("enum").get<std::vector<std::string>>(),
            action_names());
  EXPECT_EQ(defs.at("format").at("const").get<std::string>(), kPlanFormat);
}

TEST(Plan, ParseNamesValuesAndLoadReadsThem) {
  const nlohmann::json steps =
      nlohmann::json::array({{{"at", "a.output"}, {"do", "add"}, {"value", "none.safetensors:v"}}});
  const auto plan = Plan::parse(steps, "plan.json");
  EXPECT_EQ(plan.steps.at(0).value, "none.safetensors:v");
  EXPECT_FALSE(plan.steps.at(0).value_tensor.defined());
  EXPECT_THAT(parse_error(steps), HasSubstr("none.safetensors"));
}

TEST(Plan, EveryFieldIsCheckedWhateverTheAction) {
  // The schema types every field wherever it appears; so does the parser (it used to read only what the
  // action needs, letting "by": "2" beside a save through).
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "save"}, {"as", "x"}, {"by", "2"}}}),
              HasSubstr("intervention 0: \"by\" must be a number, got \"2\""));
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "zero"}, {"as", "logits"}}}), HasSubstr("is reserved"));
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "save"}, {"as", "x"}, {"value", "v"}}}),
              HasSubstr("\"value\" must be \"file.safetensors:tensor\", got \"v\""));
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "zero"}, {"modules", nlohmann::json::array()}}}),
              HasSubstr("\"modules\" is empty"));
  EXPECT_EQ(parse_error({{{"at", "a.output"}, {"do", "add"}}}),
            "plan.json: intervention 0: \"add\" needs \"value\": \"file.safetensors:tensor\"");
  EXPECT_EQ(parse_error({{{"at", "a.output"}, {"do", "scale"}}}),
            "plan.json: intervention 0: \"scale\" needs \"by\": the factor");
  EXPECT_THAT(parse_error({{{"at", "a.output"}, {"do", "call"}, {"as", "y"}}}),
              HasSubstr("\"call\" needs \"modules\""));
  // Read but not used where the action takes none: a step's canonical text is unchanged by them.
  const auto plain = parse({{{"at", "a.output"}, {"do", "zero"}}}).steps.at(0).describe();
  EXPECT_EQ(
      parse({{{"at", "a.output"}, {"do", "zero"}, {"as", "x"}, {"by", 2}, {"modules", {"m"}}}}).steps.at(0).describe(),
      plain);
}

// q 4 heads of 16, k and v 2 heads of 16 and 8: ir::qkv_output_heads of such a layer.
const ir::HeadLayout kQkv = {{"q", 0, 64, 16}, {"k", 64, 96, 16}, {"v", 96, 112, 8}};
const ir::HeadLayout kOProj = {{"heads", 0, 32, 8}};
constexpr const char* kQkvAt = "model.layers.0.self_attn.qkv_proj.output";

/// The one step of `step`, parsed and resolved against `layout`.
PlanStep resolved(const nlohmann::json& step, const ir::HeadLayout& layout) {
  auto plan = parse(nlohmann::json::array({step}));
  resolve_heads(plan.steps.at(0), layout, "plan.json: intervention 0: ");
  return plan.steps.at(0);
}

std::string resolve_error(const nlohmann::json& step, const ir::HeadLayout& layout) {
  try {
    resolved(step, layout);
  } catch (const Error& e) {
    return e.what();
  }
  return "(accepted)";
}

std::string index_of(const PlanStep& step) { return step.index ? step.index->text : "(none)"; }

TEST(Plan, SegmentsAndHeadsBecomeAnIndexOnTheLastDim) {
  EXPECT_EQ(index_of(resolved({{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}}, kQkv)), "...,64:96");
  EXPECT_EQ(index_of(resolved({{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}, {"heads", {1}}}, kQkv)),
            "...,80:96");
  EXPECT_EQ(index_of(resolved({{"at", kQkvAt}, {"do", "zero"}, {"segment", "v"}, {"heads", {1}}}, kQkv)),
            "...,104:112");
  EXPECT_EQ(index_of(resolved({{"at", kQkvAt}, {"do", "scale"}, {"by", 2}, {"segment", "q"}, {"heads", {1, 2}}},
                              kQkv)),
            "...,16:48");
  EXPECT_EQ(index_of(resolved({{"at", "o.input"}, {"do", "save"}, {"as", "h"}, {"heads", {3}}}, kOProj)),
            "...,24:32");
  // An index of the leading dims goes first.
  EXPECT_EQ(index_of(resolved({{"at", kQkvAt}, {"do", "zero"}, {"index", "0,..."}, {"segment", "k"}}, kQkv)),
            "0,...,64:96");
  // The resolved step is an ordinary indexed step: what ranks compare says where it lands.
  const auto step = resolved({{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}, {"heads", {0}}}, kQkv);
  EXPECT_TRUE(step.segment.empty());
  EXPECT_TRUE(step.heads.empty());
  EXPECT_THAT(step.describe(), HasSubstr("...,64:80"));
  // Without segment or heads, a step is left alone.
  EXPECT_EQ(index_of(resolved({{"at", kQkvAt}, {"do", "zero"}, {"index", "...,1:2"}}, {})), "...,1:2");
}

TEST(Plan, NegativeHeadsCountFromTheEndOfTheSegment) {
  const auto at = [](const nlohmann::json& heads, const char* segment = "q") {
    return index_of(resolved({{"at", kQkvAt}, {"do", "zero"}, {"segment", segment}, {"heads", heads}}, kQkv));
  };
  // -1 is the last head, as in Python, and the same step as its positive number.
  EXPECT_EQ(at({-1}), "...,48:64");
  EXPECT_EQ(at({-1}), at({3}));
  EXPECT_EQ(at({-4}), at({0}));
  EXPECT_EQ(at({-1}, "k"), at({1}, "k"));
  EXPECT_EQ(at({-1}, "v"), "...,104:112");
  EXPECT_EQ(at({-2, -1}), at({2, 3}));
  EXPECT_EQ(at({2, -1}), at({2, 3})) << "a mixed run is consecutive once normalised";
  EXPECT_EQ(index_of(resolved({{"at", "o.input"}, {"do", "save"}, {"as", "h"}, {"heads", {-1}}}, kOProj)),
            "...,24:32");
  // What ranks compare is the normalised index: -1 and 3 are one step.
  const auto negative = resolved({{"at", kQkvAt}, {"do", "zero"}, {"segment", "q"}, {"heads", {-1}}}, kQkv);
  const auto positive = resolved({{"at", kQkvAt}, {"do", "zero"}, {"segment", "q"}, {"heads", {3}}}, kQkv);
  EXPECT_EQ(negative.describe(), positive.describe());
}

TEST(Plan, OutOfRangeNegativeHeadsAreRefusedInTheUsersWords) {
  EXPECT_EQ(resolve_error({{"at", kQkvAt}, {"do", "zero"}, {"segment", "q"}, {"heads", {-5}}}, kQkv),
            "plan.json: intervention 0: model.layers.0.self_attn.qkv_proj.output: segment q has 4 heads (0 to 3, or "
            "-4 to -1), got head -5");
  EXPECT_EQ(resolve_error({{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}, {"heads", {-3, -2}}}, kQkv),
            "plan.json: intervention 0: model.layers.0.self_attn.qkv_proj.output: segment k has 2 heads (0 to 1, or "
            "-2 to -1), got head -3");
  EXPECT_EQ(resolve_error({{"at", "o.input"}, {"do", "zero"}, {"heads", {-9}}}, kOProj),
            "plan.json: intervention 0: o.input has 4 heads (0 to 3, or -4 to -1), got head -9");
  // Duplicates and gaps show only once normalised.
  EXPECT_EQ(resolve_error({{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}, {"heads", {1, -1}}}, kQkv),
            "plan.json: intervention 0: model.layers.0.self_attn.qkv_proj.output: segment k: \"heads\" [1, -1] are "
            "heads [1, 1] of 2, not consecutive heads in ascending order; write one step per run of heads");
  EXPECT_THAT(resolve_error({{"at", kQkvAt}, {"do", "zero"}, {"segment", "q"}, {"heads", {1, -1}}}, kQkv),
              HasSubstr("\"heads\" [1, -1] are heads [1, 3] of 4, not consecutive"));
  EXPECT_THAT(resolve_error({{"at", "o.input"}, {"do", "zero"}, {"heads", {3, -4}}}, kOProj),
              HasSubstr("o.input: \"heads\" [3, -4] are heads [3, 0] of 4, not consecutive"));
}

TEST(Plan, SegmentAndHeadsAreValidatedAtParse) {
  EXPECT_THAT(parse_error({{{"at", kQkvAt}, {"do", "zero"}, {"segment", 1}}}),
              HasSubstr("intervention 0: \"segment\" must be a string (q, k or v), got 1"));
  EXPECT_THAT(parse_error({{{"at", kQkvAt}, {"do", "zero"}, {"segment", ""}}}), HasSubstr("\"segment\" is empty"));
  EXPECT_THAT(parse_error({{{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}, {"heads", 1}}}),
              HasSubstr("\"heads\" must be a non-empty list of head numbers, e.g. [2], got 1"));
  EXPECT_THAT(parse_error({{{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}, {"heads", {0.5}}}}),
              HasSubstr("\"heads\" must be a non-empty list of head numbers, e.g. [2], got [0.5]"));
  EXPECT_THAT(parse_error({{{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}, {"heads", nlohmann::json::array()}}}),
              HasSubstr("\"heads\" must be a non-empty list of head numbers, e.g. [2], got []"));
  EXPECT_THAT(parse_error({{{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}, {"heads", {0, 2}}}}),
              HasSubstr("\"heads\" must be consecutive head numbers in ascending order (e.g. [2, 3], or [-2, -1] "
                        "counted from the end), got [0,2]; write one step per run of heads"));
  EXPECT_THAT(parse_error({{{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}, {"heads", {1, 0}}}}),
              HasSubstr("must be consecutive"));
  // Negative heads count from the end: a run of one sign is checked at parse, whatever the layout.
  EXPECT_EQ(parse_error({{{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}, {"heads", {-2, -1}}}}), "(accepted)");
  EXPECT_EQ(parse_error({{{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}, {"heads", {1, -1}}}}), "(accepted)");
  EXPECT_THAT(parse_error({{{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}, {"heads", {-1, -2}}}}),
              HasSubstr("must be consecutive"));
  EXPECT_THAT(parse_error({{{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}, {"heads", {-1, -1}}}}),
              HasSubstr("must be consecutive"));
  EXPECT_THAT(parse_error({{{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}, {"heads", {18446744073709551615ull}}}}),
              HasSubstr("is not a head number"));
  EXPECT_THAT(parse_error({{{"at", kQkvAt}, {"do", "call"}, {"as", "y"}, {"modules", {"m"}}, {"segment", "k"}}}),
              HasSubstr("\"segment\" and \"heads\" apply to edits and saves only"));
  for (const char* index : {"...,0:2", "0:2", "0,1"})
    EXPECT_THAT(parse_error({{{"at", kQkvAt}, {"do", "zero"}, {"index", index}, {"segment", "k"}}}),
                HasSubstr(fmt::format("\"index\" '{}' may address the last dim, which \"segment\"/\"heads\" select; "
                                      "end it with '...' to index the leading dims only",
                                      index)))
        << index;
  // A save still takes no explicit index, only a segment or heads.
  EXPECT_THAT(parse_error({{{"at", kQkvAt}, {"do", "save"}, {"as", "x"}, {"index", "0,..."}, {"segment", "k"}}}),
              HasSubstr("\"index\" applies to edits only"));
}

TEST(Plan, SegmentAndHeadsAreCheckedAgainstTheLayoutInTheUsersWords) {
  EXPECT_EQ(resolve_error({{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}, {"heads", {5}}}, kQkv),
            "plan.json: intervention 0: model.layers.0.self_attn.qkv_proj.output: segment k has 2 heads (0 to 1, or "
            "-2 to -1), got head 5");
  EXPECT_EQ(resolve_error({{"at", kQkvAt}, {"do", "zero"}, {"segment", "k"}, {"heads", {1, 2}}}, kQkv),
            "plan.json: intervention 0: model.layers.0.self_attn.qkv_proj.output: segment k has 2 heads (0 to 1, or "
            "-2 to -1), got head 2");
  EXPECT_EQ(resolve_error({{"at", "o.input"}, {"do", "zero"}, {"heads", {4}}}, kOProj),
            "plan.json: intervention 0: o.input has 4 heads (0 to 3, or -4 to -1), got head 4");
  EXPECT_EQ(resolve_error({{"at", kQkvAt}, {"do", "zero"}, {"segment", "key"}}, kQkv),
            "plan.json: intervention 0: model.layers.0.self_attn.qkv_proj.output: unknown segment \"key\"; it has "
            "q, k, v (did you mean \"k\"?)");
  EXPECT_THAT(resolve_error({{"at", kQkvAt}, {"do", "zero"}, {"segment", "x"}}, kQkv),
              HasSubstr("unknown segment \"x\"; it has q, k, v"));
  EXPECT_THAT(resolve_error({{"at", kQkvAt}, {"do", "zero"}, {"segment", "x"}}, kQkv), Not(HasSubstr("did you mean")));
  EXPECT_EQ(resolve_error({{"at", kQkvAt}, {"do", "zero"}, {"heads", {0}}}, kQkv),
            "plan.json: intervention 0: model.layers.0.self_attn.qkv_proj.output: \"heads\" needs a \"segment\" "
            "(q, k, v) to count heads in");
  EXPECT_EQ(resolve_error({{"at", "o.input"}, {"do", "zero"}, {"segment", "q"}}, kOProj),
            "plan.json: intervention 0: o.input has no segments: its heads span the whole width; use \"heads\" "
            "alone");
  EXPECT_EQ(resolve_error({{"at", "m.output"}, {"do", "zero"}, {"segment", "k"}}, {}),
            "plan.json: intervention 0: m.output has no attention heads: \"segment\" and \"heads\" apply at a "
            "QKVParallelLinear's output (q, k, v) and at the input of the o_proj beside it");
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
              HasSubstr("x.safetensors: tensor 'v' has shape [4611686018427387904, 8] of F32, whose size in bytes "
                        "overflows"));
  // Issue 16: LibTorch's "Stride calculation overflowed" named neither the file nor the tensor.
  EXPECT_THAT(read_error(safetensors_with_header(
                  R"({"v":{"dtype":"U8","shape":[0,4611686018427387904,4],"data_offsets":[0,0]}})")),
              HasSubstr("x.safetensors: tensor 'v' has shape [0, 4611686018427387904, 4], whose element count "
                        "overflows int64"));
  EXPECT_THAT(read_error(safetensors_with_header(
                  R"({"v":{"dtype":"U8","shape":[3037000500,3037000500],"data_offsets":[0,0]}})")),
              HasSubstr("x.safetensors: tensor 'v' has shape [3037000500, 3037000500], whose element count "
                        "overflows int64"));
  EXPECT_THAT(read_error(safetensors_with_header(
                  R"({"v":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,0]}})")),
              HasSubstr("x.safetensors: tensor 'v' has shape [18446744073709551615]: 18446744073709551615 is not a "
                        "size (a whole number below 2^63)"));
  EXPECT_THAT(read_error(safetensors_with_header(R"({"v":{"dtype":"F32","shape":[1e30],"data_offsets":[0,0]}})")),
              HasSubstr("tensor 'v' has shape [1e+30]: 1e+30 is not a size"));
  EXPECT_THAT(read_error(safetensors_with_header(R"({"v":{"dtype":"F32","shape":[1000000000000],"data_offsets":[0,16]}})", 16)),
              HasSubstr("data offsets that do not fit"));
  // An empty tensor is fine.
  const auto empty = read_safetensors(safetensors_with_header(R"({"e":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})"));
  ASSERT_EQ(empty.count("e"), 1u);
  EXPECT_EQ(empty.at("e").numel(), 0);
}

}  // namespace
}  // namespace frag::runtime
