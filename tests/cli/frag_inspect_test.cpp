//===- tests/cli/frag_inspect_test.cpp - `frag inspect` end to end -------===//
//
// Runs the frag binary on the reference exports made by the Python kit and
// checks the report against the layouts in fragment-rules.md: the exact set of
// fragmented locations with their layout, whole width and group at tp = 1, 2
// and 4 (llama, llama with 2 kv heads, qwen2-moe), the rank-local values
// between column and row layers, the whole locations, that the JSON document
// says the same as the text, and that every rank file of an export gives the
// same report. Bad input ends with one "frag: error: …" line on stderr naming
// the file and the problem, a non-zero exit and nothing on stdout.
//
//===----------------------------------------------------------------------===//
#include "ir/fragment_rule.h"
#include "tests/support/inspect_json.h"
#include "tests/support/test_support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/script.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <regex>
#include <set>

namespace frag {
namespace {

using testing::frag;
using testing::inspect_json;
using testing::lines_of;
using testing::model_files;
using testing::read_text;
using testing::temporary_folder;
using testing::write_text;

// ---------------------------------------------------------------------------
// Running frag (testing::frag: stdout and stderr apart)

std::vector<std::string> with(std::vector<std::string> head, const std::vector<std::string>& tail) {
  head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

// ---------------------------------------------------------------------------
// The text report, parsed back

struct TextRow {
  std::string class_name, layout, whole, group;
  bool operator==(const TextRow& o) const {
    return class_name == o.class_name && layout == o.layout && whole == o.whole && group == o.group;
  }
};

std::ostream& operator<<(std::ostream& os, const TextRow& r) {
  return os << "{" << r.class_name << " | " << r.layout << " | " << r.whole << " | " << r.group << "}";
}

struct TextReport {
  std::string header;
  int64_t tp_size = -1;
  int64_t parallel_layers = -1;
  int64_t fragmented_count = -1, rank_local_count = -1, whole_count = -1;  ///< as the section titles say
  std::map<std::string, TextRow> fragmented;
  std::vector<std::string> fragmented_order;
  std::map<std::string, std::string> rank_local;  ///< location -> derived from
  std::vector<std::string> whole;                 ///< only with --all
  std::map<std::string, std::string> heads;       ///< location -> its regions, as printed
  int64_t heads_count = -1;
};

TextReport parse_text(const std::string& text) {
  TextReport report;
  auto lines = lines_of(text);
  if (lines.empty()) {
    ADD_FAILURE() << "empty report";
    return report;
  }
  report.header = lines[0];
  std::smatch m;
  if (std::regex_search(report.header, m, std::regex(R"(: tp_size (\d+), (\d+) parallel layers$)"))) {
    report.tp_size = std::stoll(m[1]);
    report.parallel_layers = std::stoll(m[2]);
  } else {
    ADD_FAILURE() << "unexpected header line: " << report.header;
  }
  enum { kNone, kFragmented, kHeads, kRankLocal, kWhole } section = kNone;
  const std::regex title(R"(^(fragmented locations|attention heads|rank-local values|whole locations) \((\d+)\): )");
  const std::regex columns(R"(\s{2,})");
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::string& line = lines[i];
    if (line.empty()) continue;
    if (std::regex_search(line, m, title)) {
      const int64_t count = std::stoll(m[2]);
      if (m[1] == "fragmented locations") section = kFragmented, report.fragmented_count = count;
      if (m[1] == "rank-local values") section = kRankLocal, report.rank_local_count = count;
      if (m[1] == "whole locations") section = kWhole, report.whole_count = count;
      if (m[1] == "attention heads") section = kHeads, report.heads_count = count;
      continue;
    }
    if (line.rfind("  ", 0) != 0) {
      ADD_FAILURE() << "unexpected line " << i + 1 << ": " << line;
      continue;
    }
    const std::string body = line.substr(2);
    if (section == kFragmented) {
      if (body.rfind("LOCATION ", 0) == 0) continue;  // column titles
      std::vector<std::string> cells(std::sregex_token_iterator(body.begin(), body.end(), columns, -1),
                                     std::sregex_token_iterator());
      while (!cells.empty() && cells.back().empty()) cells.pop_back();
      if (cells.size() != 5) {
        ADD_FAILURE() << "a fragmented row should have 5 columns: " << line;
        continue;
      }
      EXPECT_EQ(report.fragmented.count(cells[0]), 0u) << "listed twice: " << cells[0];
      report.fragmented[cells[0]] = TextRow{cells[1], cells[2], cells[3], cells[4]};
      report.fragmented_order.push_back(cells[0]);
    } else if (section == kHeads) {
      if (!std::regex_match(body, m, std::regex(R"(^(\S+)  +(\S.*)$)"))) {
        ADD_FAILURE() << "unexpected heads line: " << line;
        continue;
      }
      report.heads[m[1]] = m[2];
    } else if (section == kRankLocal) {
      if (!std::regex_match(body, m, std::regex(R"(^(\S+)  \(from (\S+)\)$)"))) {
        ADD_FAILURE() << "unexpected rank-local line: " << line;
        continue;
      }
      report.rank_local[m[1]] = m[2];
    } else if (section == kWhole) {
      report.whole.push_back(body);
    } else {
      ADD_FAILURE() << "a row outside any section: " << line;
    }
  }
  EXPECT_GE(report.fragmented_count, 0) << "no 'fragmented locations' section\n" << text;
  EXPECT_GE(report.rank_local_count, 0) << "no 'rank-local values' section\n" << text;
  EXPECT_GE(report.whole_count, 0) << "no 'whole locations' section\n" << text;
  return report;
}

// ---------------------------------------------------------------------------
// What fragment-rules.md says the reference models hold

struct Expected {
  std::string class_name, layout;
  int64_t whole_width;
  std::string group;  ///< "tp" or "tp×ep"
};
using ExpectedTable = std::map<std::string, Expected>;

/// The tiny llama of fragkit: hidden 64, 8 heads of 8, intermediate 128,
/// vocab 1000 (padded to 1024), 2 decoder layers. qkv_layout/qkv_width depend on the kv heads.
ExpectedTable llama_expected(const std::string& qkv_layout, int64_t qkv_width) {
  ExpectedTable t;
  for (std::string n : {"0", "1"}) {
    const std::string l = "model.layers." + n;
    t[l + ".self_attn.qkv_proj.output"] = {"QKVParallelLinear", qkv_layout, qkv_width, "tp"};
    t[l + ".self_attn.o_proj.input"] = {"RowParallelLinear", "shard(-1)", 64, "tp"};
    t[l + ".mlp.gate_up_proj.output"] = {"MergedColumnParallelLinear", "segments gate=128 up=128", 256, "tp"};
    t[l + ".mlp.down_proj.input"] = {"RowParallelLinear", "shard(-1)", 128, "tp"};
  }
  t["lm_head.output"] = {"ParallelLMHead", "vocab shard, org 1000, padded 1024", 1000, "tp"};
  t["logits_processor.input"] = {"LogitsProcessor", "vocab shard, org 1000, padded 1024", 1000, "tp"};
  return t;
}

/// The tiny llama with the GPT-NeoX style MLP (export_model.py --mlp plain): up_proj is a plain
/// ColumnParallelLinear (gather_output=False), so its output is shard(-1) of the whole intermediate
/// (128); GELU; down_proj's input is the row shard as in llama.
constexpr int64_t kPlainMlpIntermediate = 128;

ExpectedTable llama_plain_mlp_expected() {
  ExpectedTable t;
  for (std::string n : {"0", "1"}) {
    const std::string l = "model.layers." + n;
    t[l + ".self_attn.qkv_proj.output"] = {"QKVParallelLinear", "segments q=64 k=32 v=32", 128, "tp"};
    t[l + ".self_attn.o_proj.input"] = {"RowParallelLinear", "shard(-1)", 64, "tp"};
    t[l + ".mlp.up_proj.output"] = {"ColumnParallelLinear", "shard(-1)", kPlainMlpIntermediate, "tp"};
    t[l + ".mlp.down_proj.input"] = {"RowParallelLinear", "shard(-1)", kPlainMlpIntermediate, "tp"};
  }
  t["lm_head.output"] = {"ParallelLMHead", "vocab shard, org 1000, padded 1024", 1000, "tp"};
  t["logits_processor.input"] = {"LogitsProcessor", "vocab shard, org 1000, padded 1024", 1000, "tp"};
  return t;
}

bool is_plain_mlp(const std::string& name) { return name.rfind("llama_plain_mlp", 0) == 0; }

/// The tiny qwen2-moe: attention as llama, 4 experts of intermediate 32 whose
/// output stays a partial sum (reduce_results=False), a shared expert MLP of
/// intermediate 64 whose down_proj output stays a partial sum too.
ExpectedTable moe_expected(int tp) {
  ExpectedTable t;
  const std::string p = std::to_string(tp);
  for (std::string n : {"0", "1"}) {
    const std::string l = "model.layers." + n;
    t[l + ".self_attn.qkv_proj.output"] = {"QKVParallelLinear", "segments q=64 k=32 v=32", 128, "tp"};
    t[l + ".self_attn.o_proj.input"] = {"RowParallelLinear", "shard(-1)", 64, "tp"};
    t[l + ".mlp.experts.output"] = {"FusedMoE", "partial sum over tp×ep = " + p, 64, "tp×ep"};
    t[l + ".mlp.shared_expert.gate_up_proj.output"] = {"MergedColumnParallelLinear",
                                                       "segments gate=64 up=64", 128, "tp"};
    t[l + ".mlp.shared_expert.down_proj.input"] = {"RowParallelLinear", "shard(-1)", 64, "tp"};
    t[l + ".mlp.shared_expert.down_proj.output"] = {"RowParallelLinear", "partial sum over tp = " + p, 64, "tp"};
  }
  t["lm_head.output"] = {"ParallelLMHead", "vocab shard, org 1000, padded 1024", 1000, "tp"};
  t["logits_processor.input"] = {"LogitsProcessor", "vocab shard, org 1000, padded 1024", 1000, "tp"};
  return t;
}

struct Case {
  const char* name;     ///< export
  const char* tp1;      ///< the same model at tp 1
  int tp;
  int parallel_layers;  ///< known layer instances in the file
  ExpectedTable (*expected)();
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

/// At tp 1 only the padded vocab is a fragment (one rank holds it all): the
/// lm_head's output has 1024 columns of which the whole is the first 1000, so
/// the location reads the same as at any tp size.
ExpectedTable tp1_expected() {
  ExpectedTable t;
  t["lm_head.output"] = {"ParallelLMHead", "vocab shard, org 1000, padded 1024", 1000, "tp"};
  t["logits_processor.input"] = {"LogitsProcessor", "vocab shard, org 1000, padded 1024", 1000, "tp"};
  return t;
}

const Case kCases[] = {
    {"llama_tp2", "llama_tp1", 2, 11, [] { return llama_expected("segments q=64 k=32 v=32", 128); }},
    {"llama_tp4", "llama_tp1", 4, 11, [] { return llama_expected("segments q=64 k=32 v=32", 128); }},
    // 2 kv heads at tp 4: each rank holds one kv head, every kv head on 2 ranks.
    {"llama_kv2_tp4", "llama_kv2_tp1", 4, 11,
     [] { return llama_expected("segments q=64 k=16 v=16, kv replicas 2", 96); }},
    // A plain ColumnParallelLinear output (up_proj, gather_output=False): shard(-1).
    {"llama_plain_mlp_tp2", "llama_plain_mlp_tp1", 2, 11, llama_plain_mlp_expected},
    {"llama_plain_mlp_tp4", "llama_plain_mlp_tp1", 4, 11, llama_plain_mlp_expected},
    {"moe_tp2", "moe_tp1", 2, 17, [] { return moe_expected(2); }},
    {"moe_tp4", "moe_tp1", 4, 17, [] { return moe_expected(4); }},
    // Expert parallel: the layer's tp_size is 1 and ep_size 2; the partial sum spans tp×ep = 2.
    {"moe_ep_tp2", "moe_tp1", 2, 17, [] { return moe_expected(2); }},
};

TextReport inspect_text(const std::vector<std::string>& files, bool all = true) {
  auto args = with({"inspect"}, files);
  if (all) args.push_back("--all");
  auto result = frag(args);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(result.err, "");
  return parse_text(result.out);
}

/// "1 rank", "2 ranks": a group's size as frag inspect shows it.
std::string ranks(int64_t count) { return std::to_string(count) + (count == 1 ? " rank" : " ranks"); }

std::set<std::string> json_strings(const nlohmann::json& array) {
  std::set<std::string> s;
  for (const auto& v : array) s.insert(v.get<std::string>());
  return s;
}

// ---------------------------------------------------------------------------
// Reports of the reference exports

class InspectReference : public ::testing::TestWithParam<Case> {};

TEST_P(InspectReference, TextListsExactlyTheFragmentedLocationsOfTheRules) {
  const Case& c = GetParam();
  auto files = model_files(c.name);
  ASSERT_EQ(files.size(), static_cast<size_t>(c.tp));
  auto report = inspect_text({files[0]}, false);
  EXPECT_EQ(report.header, files[0] + ": tp_size " + std::to_string(c.tp) + ", " +
                               std::to_string(c.parallel_layers) + " parallel layers");

  std::map<std::string, TextRow> expected;
  for (const auto& [location, e] : c.expected())
    expected[location] = TextRow{e.class_name, e.layout, "[..., " + std::to_string(e.whole_width) + "]",
                                 e.group + " (" + ranks(c.tp) + ")"};
  EXPECT_EQ(report.fragmented, expected);
  EXPECT_EQ(report.fragmented_count, static_cast<int64_t>(expected.size()));
  // Without --all the whole locations are only counted.
  EXPECT_TRUE(report.whole.empty());
  EXPECT_GT(report.whole_count, 0);
}

TEST_P(InspectReference, JsonHoldsTheSameFragmentsWithTheirRules) {
  const Case& c = GetParam();
  auto files = model_files(c.name);
  auto json = inspect_json({files[0]});
  ASSERT_TRUE(json.is_object());
  EXPECT_EQ(json.value("format", ""), "fragments.inspect/1");
  EXPECT_EQ(json["files"], nlohmann::json(std::vector<std::string>{files[0]}));
  EXPECT_EQ(json.value("tp_size", -1), c.tp);
  ASSERT_TRUE(json["fragmented"].is_array());
  ASSERT_TRUE(json["layers"].is_array());
  EXPECT_EQ(json["layers"].size(), static_cast<size_t>(c.parallel_layers));

  const auto expected = c.expected();
  std::set<std::string> seen;
  for (const auto& f : json["fragmented"]) {
    const std::string location = f.at("location");
    SCOPED_TRACE(location);
    seen.insert(location);
    auto it = expected.find(location);
    if (it == expected.end()) {
      ADD_FAILURE() << "not a fragmented location by the rules";
      continue;
    }
    const Expected& e = it->second;
    EXPECT_EQ(f.at("class"), e.class_name);
    EXPECT_EQ(f.at("kind"), e.class_name);
    EXPECT_EQ(f.at("layout"), e.layout);
    EXPECT_EQ(f.at("whole_width"), e.whole_width);
    EXPECT_EQ(f.at("group"), e.group);
    EXPECT_EQ(f.at("group_size"), c.tp);
    const std::string side = location.substr(location.rfind('.') + 1);
    EXPECT_EQ(f.at("side"), side);
    // The rule is a valid ir rule, describes itself as the layout column, and
    // has the numbers fragment-rules.md gives.
    ir::FragmentRule rule;
    try {
      rule = ir::rule_from_json(f.at("rule"));
    } catch (const std::exception& error) {
      ADD_FAILURE() << "rule does not parse: " << error.what() << "\n" << f.at("rule").dump();
      continue;
    }
    EXPECT_EQ(ir::describe(rule), e.layout);
    EXPECT_EQ(rule.group, e.group);
    EXPECT_EQ(rule.group_size, c.tp);
    if (rule.kind == ir::LayoutKind::kQkv) {
      EXPECT_EQ(rule.num_heads, 8);
      EXPECT_EQ(rule.head_size, 8);
      EXPECT_EQ(rule.v_head_size, 8);
      EXPECT_EQ(rule.num_kv_heads * 8 * 2 + 64, e.whole_width);
      EXPECT_EQ(rule.kv_replicas(), rule.num_kv_heads < c.tp ? c.tp / rule.num_kv_heads : 1);
    } else if (rule.kind == ir::LayoutKind::kVocabShard) {
      EXPECT_EQ(rule.org_vocab, 1000);
      EXPECT_EQ(rule.padded_vocab, 1024);  // ceil(1000 / 64) * 64
      EXPECT_EQ(rule.dim, -1);
    } else if (rule.kind == ir::LayoutKind::kSegments) {
      EXPECT_EQ(rule.segment_names, (std::vector<std::string>{"gate", "up"}));
      EXPECT_EQ(rule.segment_sizes, (std::vector<int64_t>{e.whole_width / 2, e.whole_width / 2}));
    } else if (rule.kind == ir::LayoutKind::kShard) {
      EXPECT_EQ(rule.dim, -1);
      // Plain shards here: row layers' inputs and a plain column layer's output.
      EXPECT_EQ(side, e.class_name == "ColumnParallelLinear" ? "output" : "input");
    } else if (rule.kind == ir::LayoutKind::kPartialSum) {
      EXPECT_EQ(side, "output");
    } else {
      ADD_FAILURE() << "unexpected rule kind " << ir::kind_name(rule.kind);
    }
  }
  std::set<std::string> expected_locations;
  for (const auto& [location, e] : expected) expected_locations.insert(location);
  EXPECT_EQ(seen, expected_locations);
  EXPECT_EQ(json["fragmented"].size(), expected.size()) << "a location is listed twice";
}

TEST_P(InspectReference, JsonAgreesWithTheText) {
  const Case& c = GetParam();
  auto files = model_files(c.name);
  auto json = inspect_json({files[0]});
  auto text = inspect_text({files[0]}, true);
  ASSERT_TRUE(json.contains("fragmented") && json.contains("rank_local") && json.contains("whole"));

  EXPECT_EQ(text.tp_size, json["tp_size"].get<int64_t>());
  EXPECT_EQ(text.parallel_layers, static_cast<int64_t>(json["layers"].size()));
  std::map<std::string, TextRow> from_json;
  std::vector<std::string> json_order;
  for (const auto& f : json["fragmented"]) {
    from_json[f["location"]] = TextRow{f["class"], f["layout"],
                                       "[..., " + std::to_string(f["whole_width"].get<int64_t>()) + "]",
                                       f["group"].get<std::string>() + " (" +
                                           ranks(f["group_size"].get<int64_t>()) + ")"};
    json_order.push_back(f["location"]);
  }
  EXPECT_EQ(text.fragmented, from_json);
  EXPECT_EQ(text.fragmented_order, json_order);
  EXPECT_EQ(text.fragmented_count, static_cast<int64_t>(json["fragmented"].size()));

  std::map<std::string, std::string> rank_local;
  for (const auto& r : json["rank_local"]) rank_local[r["location"]] = r["derived_from"];
  EXPECT_EQ(text.rank_local, rank_local);
  EXPECT_EQ(text.rank_local_count, static_cast<int64_t>(json["rank_local"].size()));

  EXPECT_EQ(text.whole, json["whole"].get<std::vector<std::string>>());
  EXPECT_EQ(text.whole_count, static_cast<int64_t>(json["whole"].size()));

  // Regions in last-dim order (JSON objects sort their keys).
  std::map<std::string, std::string> heads;
  for (const auto& [location, regions] : json["heads"].items()) {
    std::vector<std::pair<int64_t, std::string>> ordered;
    for (const auto& [name, r] : regions.items())
      ordered.emplace_back(r["start"].get<int64_t>(),
                           name + " " + std::to_string(r["start"].get<int64_t>()) + ":" +
                               std::to_string(r["stop"].get<int64_t>()) + " (" +
                               std::to_string(r["heads"].get<int64_t>()) + " heads, head_dim " +
                               std::to_string(r["head_dim"].get<int64_t>()) + ")");
    std::sort(ordered.begin(), ordered.end());
    std::string line;
    for (const auto& [_, region] : ordered) line += (line.empty() ? "" : ", ") + region;
    heads[location] = line;
  }
  EXPECT_EQ(text.heads, heads);
  EXPECT_EQ(text.heads_count, static_cast<int64_t>(json["heads"].size()));
}

// ---------------------------------------------------------------------------
// Attention heads: q/k/v of qkv_proj's output and o_proj's input, at every tp size

struct HeadsCase {
  const char* name;
  int64_t kv_heads;  ///< llama: 8 q heads of 8; kv heads as exported
};

class InspectHeads : public ::testing::TestWithParam<HeadsCase> {};

nlohmann::json region(int64_t start, int64_t stop, int64_t heads, int64_t head_dim) {
  return {{"start", start}, {"stop", stop}, {"heads", heads}, {"head_dim", head_dim}};
}

TEST_P(InspectHeads, QkvOutputsAndOProjInputsListTheirHeads) {
  const auto& c = GetParam();
  auto json = inspect_json({model_files(c.name)[0]});
  ASSERT_TRUE(json["heads"].is_object()) << json.dump(1);
  const int64_t k_stop = 64 + 8 * c.kv_heads;
  nlohmann::json expected = nlohmann::json::object();
  for (std::string l : {"model.layers.0", "model.layers.1"}) {
    expected[l + ".self_attn.qkv_proj.output"] = {{"q", region(0, 64, 8, 8)},
                                                  {"k", region(64, k_stop, c.kv_heads, 8)},
                                                  {"v", region(k_stop, k_stop + 8 * c.kv_heads, c.kv_heads, 8)}};
    expected[l + ".self_attn.o_proj.input"] = {{"heads", region(0, 64, 8, 8)}};
  }
  EXPECT_EQ(json["heads"], expected) << json["heads"].dump(1);
  auto text = inspect_text({model_files(c.name)[0]}, false);
  EXPECT_EQ(text.heads_count, 4);
  EXPECT_EQ(text.heads["model.layers.1.self_attn.qkv_proj.output"],
            "q 0:64 (8 heads, head_dim 8), k 64:" + std::to_string(k_stop) + " (" + std::to_string(c.kv_heads) +
                " heads, head_dim 8), v " + std::to_string(k_stop) + ":" + std::to_string(k_stop + 8 * c.kv_heads) +
                " (" + std::to_string(c.kv_heads) + " heads, head_dim 8)");
  EXPECT_EQ(text.heads["model.layers.0.self_attn.o_proj.input"], "heads 0:64 (8 heads, head_dim 8)");
}

// At tp 1 qkv_proj's output is whole, not fragmented: its heads are listed all the same.
INSTANTIATE_TEST_SUITE_P(ReferenceModels, InspectHeads,
                         ::testing::Values(HeadsCase{"llama_tp1", 4}, HeadsCase{"llama_tp2", 4},
                                           HeadsCase{"llama_kv2_tp1", 2}, HeadsCase{"llama_kv2_tp4", 2}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST_P(InspectReference, EveryLocationIsFragmentedRankLocalOrWholeExactlyOnce) {
  // The tp=1 export of the same model has the same locations; at tp > 1 they
  // split into the three kinds without overlap.
  const Case& c = GetParam();
  auto json = inspect_json({model_files(c.name)[0]});
  auto tp1 = inspect_json({model_files(c.tp1)[0]});
  std::set<std::string> all = json_strings(tp1["whole"]);
  for (const auto& f : tp1["fragmented"]) all.insert(f["location"].get<std::string>());
  ASSERT_GT(all.size(), 50u);
  std::multiset<std::string> parts;
  for (const auto& f : json["fragmented"]) parts.insert(f["location"].get<std::string>());
  for (const auto& r : json["rank_local"]) parts.insert(r["location"].get<std::string>());
  for (const auto& w : json["whole"]) parts.insert(w.get<std::string>());
  EXPECT_EQ(std::set<std::string>(parts.begin(), parts.end()), all);
  EXPECT_EQ(parts.size(), all.size()) << "a location is in two categories";
}

TEST_P(InspectReference, WholeLocationsIncludeTheResidualStreamAndTheEmbedding) {
  const Case& c = GetParam();
  auto json = inspect_json({model_files(c.name)[0]});
  const auto whole = json_strings(json["whole"]);
  for (const char* location : {"model.embed_tokens.output",  // vocab embedding all-reduces itself
                               "model.embed_tokens.input", "model.layers.0.output", "model.layers.1.output",
                               "model.layers.0.self_attn.qkv_proj.input",   // column input: replicated
                               "model.layers.0.self_attn.o_proj.output",    // reduce_results=True
                               "model.layers.0.mlp.output", "model.norm.output", "lm_head.input",
                               "logits_processor.output"})
    EXPECT_EQ(whole.count(location), 1u) << location;
}

TEST_P(InspectReference, ValuesBetweenColumnAndRowLayersAreRankLocal) {
  const Case& c = GetParam();
  auto json = inspect_json({model_files(c.name)[0]});
  std::map<std::string, std::string> rank_local;
  for (const auto& r : json["rank_local"]) rank_local[r["location"]] = r["derived_from"];
  std::map<std::string, std::string> expected;
  const bool moe = std::string(c.name).rfind("moe", 0) == 0;
  for (std::string n : {"0", "1"}) {
    const std::string l = "model.layers." + n;
    // q/k after rotary and the attention over this rank's heads.
    for (const char* v : {".self_attn.rotary_emb.output", ".self_attn.attn.input", ".self_attn.attn.output"})
      expected[l + v] = l + ".self_attn.qkv_proj.output";
    const std::string mlp = moe ? l + ".mlp.shared_expert" : l + ".mlp";
    // SiLU-and-mul between gate_up_proj and down_proj (GELU after up_proj in the plain MLP).
    const std::string column = mlp + (is_plain_mlp(c.name) ? ".up_proj.output" : ".gate_up_proj.output");
    expected[mlp + ".act_fn.input"] = column;
    expected[mlp + ".act_fn.output"] = column;
    // The shared expert MLP returns down_proj's partial sum; the block all-reduces later.
    if (moe) expected[mlp + ".output"] = mlp + ".down_proj.output";
  }
  EXPECT_EQ(rank_local, expected);
}

INSTANTIATE_TEST_SUITE_P(ReferenceModels, InspectReference, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(Inspect, Llama2RankLocalActFnComesFromGateUp) {
  // The brief's own example, stated plainly: llama at tp 2, text and JSON.
  auto file = model_files("llama_tp2")[0];
  auto text = inspect_text({file});
  EXPECT_EQ(text.rank_local["model.layers.0.mlp.act_fn.input"], "model.layers.0.mlp.gate_up_proj.output");
  EXPECT_EQ(text.rank_local["model.layers.0.mlp.act_fn.output"], "model.layers.0.mlp.gate_up_proj.output");
  const std::set<std::string> whole(text.whole.begin(), text.whole.end());
  EXPECT_EQ(whole.count("model.layers.0.output"), 1u);
  EXPECT_EQ(whole.count("model.embed_tokens.output"), 1u);
  EXPECT_EQ(text.fragmented.count("model.layers.0.mlp.act_fn.output"), 0u);
  EXPECT_EQ(whole.count("model.layers.0.mlp.act_fn.output"), 0u);
}

TEST(Inspect, AVocabPaddedTo192IsShardedAsTheLmHeadRecordsIt) {
  // padding_size 192 at tp 3: 1000 -> 1152 = 3 x 384 (vLLM's default 64 would give 1024, not divisible by 3).
  // The LogitsProcessor records no padding; its input is the LM head's output, padded as the head says.
  const auto files = model_files("llama_pad192_tp3");
  auto text = inspect_text(files);
  EXPECT_EQ(text.tp_size, 3);
  const TextRow head{"ParallelLMHead", "vocab shard, org 1000, padded 1152", "[..., 1000]", "tp (3 ranks)"};
  const TextRow processor{"LogitsProcessor", "vocab shard, org 1000, padded 1152", "[..., 1000]", "tp (3 ranks)"};
  EXPECT_EQ(text.fragmented["lm_head.output"], head);
  EXPECT_EQ(text.fragmented["logits_processor.input"], processor);
}

TEST(Inspect, PlainColumnOutputIsALastDimShardOfTheWholeIntermediate) {
  // llama with the plain MLP at tp 2: up_proj.output is one rank's [..., 64] block of the
  // whole [..., 128] activation, rank r holding columns [r*64, (r+1)*64).
  auto file = model_files("llama_plain_mlp_tp2")[0];
  auto json = inspect_json({file});
  const nlohmann::json* up = nullptr;
  for (const auto& f : json["fragmented"])
    if (f["location"] == "model.layers.0.mlp.up_proj.output") up = &f;
  ASSERT_NE(up, nullptr) << "up_proj.output is not fragmented";
  EXPECT_EQ((*up)["class"], "ColumnParallelLinear");
  EXPECT_EQ((*up)["side"], "output");
  EXPECT_EQ((*up)["layout"], "shard(-1)");
  EXPECT_EQ((*up)["whole_width"], kPlainMlpIntermediate);
  ir::FragmentRule rule = ir::rule_from_json((*up)["rule"]);
  EXPECT_EQ(rule.kind, ir::LayoutKind::kShard);
  EXPECT_EQ(rule.dim, -1);
  EXPECT_EQ(rule.group, "tp");
  EXPECT_EQ(rule.group_size, 2);
  // The column layer's input is replicated: whole.
  EXPECT_EQ(json_strings(json["whole"]).count("model.layers.0.mlp.up_proj.input"), 1u);
  auto text = inspect_text({file});
  EXPECT_EQ(text.fragmented["model.layers.0.mlp.up_proj.output"],
            (TextRow{"ColumnParallelLinear", "shard(-1)", "[..., 128]", "tp (2 ranks)"}));
}

class InspectTp1 : public ::testing::TestWithParam<const char*> {};

TEST_P(InspectTp1, OnlyThePaddedVocabIsFragmentedAndNothingIsRankLocal) {
  auto file = model_files(GetParam())[0];
  auto text = inspect_text({file});
  EXPECT_EQ(text.tp_size, 1);
  std::map<std::string, TextRow> expected;
  for (const auto& [location, e] : tp1_expected())
    expected[location] = TextRow{e.class_name, e.layout, "[..., 1000]", "tp (1 rank)"};  // not "1 ranks" (issue 16)
  EXPECT_EQ(text.fragmented, expected);
  EXPECT_EQ(text.fragmented_count, 2);
  EXPECT_EQ(text.rank_local_count, 0);
  EXPECT_TRUE(text.rank_local.empty());
  EXPECT_GT(text.whole_count, 40);
  EXPECT_EQ(text.whole_count, static_cast<int64_t>(text.whole.size()));

  auto json = inspect_json({file});
  EXPECT_EQ(json.value("format", ""), "fragments.inspect/1");
  EXPECT_EQ(json["tp_size"], 1);
  ASSERT_EQ(json["fragmented"].size(), 2u);
  for (const auto& f : json["fragmented"]) {
    EXPECT_EQ(f["group_size"], 1);
    EXPECT_EQ(f["rule"]["kind"], "vocab_shard");
    EXPECT_EQ(f["rule"]["padded_vocab"], 1024);
  }
  EXPECT_EQ(json["rank_local"], nlohmann::json::array());
  EXPECT_EQ(json["whole"].get<std::vector<std::string>>(), text.whole);
  const auto whole = json_strings(json["whole"]);
  // Everything a tp > 1 export shards is whole here.
  for (const char* location : {"model.layers.0.self_attn.qkv_proj.output", "model.layers.0.self_attn.o_proj.input",
                               "model.layers.1.self_attn.attn.output", "lm_head.input", "logits_processor.output",
                               "model.layers.0.output", "model.embed_tokens.output"})
    EXPECT_EQ(whole.count(location), 1u) << location;
  const bool moe = std::string(GetParam()).rfind("moe", 0) == 0;
  const std::string mlp = moe ? "model.layers.0.mlp.shared_expert" : "model.layers.0.mlp";
  const char* column = is_plain_mlp(GetParam()) ? ".up_proj.output" : ".gate_up_proj.output";
  for (const char* location : {column, ".down_proj.input", ".act_fn.output"})
    EXPECT_EQ(whole.count(mlp + location), 1u) << mlp + location;
  if (moe) {
    EXPECT_EQ(whole.count("model.layers.0.mlp.experts.output"), 1u);
    EXPECT_EQ(whole.count("model.layers.0.mlp.shared_expert.down_proj.output"), 1u);
  }
  // Every layer is still listed, and the unsharded ones say why.
  ASSERT_FALSE(json["layers"].empty());
  for (const auto& layer : json["layers"]) {
    if (layer["kind"] == "ReplicatedLinear" || layer["kind"] == "ParallelLMHead") continue;
    EXPECT_FALSE(layer["notes"].empty()) << layer.dump();
  }
}

INSTANTIATE_TEST_SUITE_P(ReferenceModels, InspectTp1,
                         ::testing::Values("llama_tp1", "llama_kv2_tp1", "llama_plain_mlp_tp1", "moe_tp1"),
                         [](const auto& info) { return std::string(info.param); });

// ---------------------------------------------------------------------------
// Several rank files of one export

class InspectAllRanks : public ::testing::TestWithParam<const char*> {};

TEST_P(InspectAllRanks, AllRankFilesGiveTheReportOfOne) {
  auto files = model_files(GetParam());
  ASSERT_GE(files.size(), 2u);
  auto one = inspect_json({files[0]});
  auto all = inspect_json(files);
  EXPECT_EQ(all["files"], nlohmann::json(files));
  ASSERT_FALSE(one["fragmented"].empty());
  for (auto* j : {&one, &all}) j->erase("files");
  EXPECT_EQ(all, one);
  // Each rank alone says the same: nothing in the report depends on the rank.
  for (size_t r = 1; r < files.size(); ++r) {
    auto alone = inspect_json({files[r]});
    alone.erase("files");
    EXPECT_EQ(alone, one) << files[r];
  }
  // The text differs only in the file list of its first line.
  auto text_one = frag({"inspect", files[0], "--all"});
  auto text_all = frag(with({"inspect"}, with(files, {"--all"})));
  ASSERT_EQ(text_one.exit_code, 0);
  ASSERT_EQ(text_all.exit_code, 0);
  std::string joined = files[0];
  for (size_t r = 1; r < files.size(); ++r) joined += ", " + files[r];
  auto lines_one = lines_of(text_one.out);
  auto lines_all = lines_of(text_all.out);
  ASSERT_FALSE(lines_one.empty());
  ASSERT_FALSE(lines_all.empty());
  EXPECT_EQ(lines_all[0].rfind(joined + ": ", 0), 0u) << lines_all[0];
  EXPECT_EQ(lines_all[0].substr(joined.size()), lines_one[0].substr(files[0].size()));
  EXPECT_EQ(std::vector<std::string>(lines_all.begin() + 1, lines_all.end()),
            std::vector<std::string>(lines_one.begin() + 1, lines_one.end()));
}

INSTANTIATE_TEST_SUITE_P(ReferenceModels, InspectAllRanks,
                         ::testing::Values("llama_tp2", "llama_kv2_tp4", "llama_plain_mlp_tp4", "moe_tp4"),
                         [](const auto& info) { return std::string(info.param); });

// ---------------------------------------------------------------------------
// --rules

/// A one-layer model whose row-parallel layer has a class name the pass does
/// not know ("MyRow"), with vLLM's config attributes, saved as TorchScript.
std::string save_custom_row_model(const std::string& folder) {
  torch::jit::Module row("MyRow");
  row.register_parameter("weight", torch::randn({8, 4}), false);  // output 8, input 8 / tp 2
  row.register_attribute("tp_size", c10::IntType::get(), int64_t{2});
  row.register_attribute("tp_rank", c10::IntType::get(), int64_t{0});
  row.register_attribute("input_size", c10::IntType::get(), int64_t{8});
  row.register_attribute("output_size", c10::IntType::get(), int64_t{8});
  row.register_attribute("input_is_parallel", c10::BoolType::get(), true);
  row.register_attribute("reduce_results", c10::BoolType::get(), false);
  row.define("def forward(self, x):\n  return torch.matmul(x, self.weight.t())\n");
  torch::jit::Module root("MyModel");
  root.register_attribute("tp_size", c10::IntType::get(), int64_t{2});
  root.register_attribute("tp_rank", c10::IntType::get(), int64_t{0});
  root.register_module("proj", row);
  root.define("def forward(self, x):\n  return self.proj.forward(x) * 2.0\n");
  const std::string path = folder + "/custom.pt";
  root.save(path);
  return path;
}

TEST(InspectRules, ARulesFileDeclaresAClassAsAKnownLayer) {
  auto folder = temporary_folder();
  const auto model = save_custom_row_model(folder);
  write_text(folder + "/rules.json", R"({"layers": {"MyRow": "RowParallelLinear"}})");
  auto plain = inspect_json({model});
  EXPECT_EQ(plain["layers"].size(), 0u) << "MyRow is unknown without the rules file";
  EXPECT_EQ(plain["fragmented"], nlohmann::json::array());

  auto declared = inspect_json({model, "--rules", folder + "/rules.json"});
  ASSERT_EQ(declared["layers"].size(), 1u);
  EXPECT_EQ(declared["layers"][0]["path"], "proj");
  EXPECT_EQ(declared["layers"][0]["class"], "MyRow");
  EXPECT_EQ(declared["layers"][0]["kind"], "RowParallelLinear");
  EXPECT_EQ(declared["tp_size"], 2);
  std::map<std::string, std::string> layouts;
  for (const auto& f : declared["fragmented"]) {
    layouts[f["location"]] = f["layout"];
    EXPECT_EQ(f["class"], "MyRow");
    EXPECT_EQ(f["kind"], "RowParallelLinear");
    EXPECT_EQ(f["group_size"], 2);
  }
  EXPECT_EQ(layouts, (std::map<std::string, std::string>{{"proj.input", "shard(-1)"},
                                                          {"proj.output", "partial sum over tp = 2"}}));
}

TEST(InspectRules, DeclaringAClassWithoutTheConfigAttributesNamesWhatIsMissing) {
  // RMSNorm has no tp_size: the error names the file, the module and the attribute.
  auto folder = temporary_folder();
  write_text(folder + "/rules.json", R"({"layers": {"RMSNorm": "ReplicatedLinear"}})");
  const auto file = model_files("llama_tp2")[0];
  auto result = frag({"inspect", file, "--rules", folder + "/rules.json"});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_EQ(result.out, "");
  EXPECT_EQ(lines_of(result.err).size(), 1u) << result.err;
  for (const std::string& e : std::vector<std::string>{
           file + ": ", "input_layernorm (RMSNorm, declared ReplicatedLinear in " + folder + "/rules.json)",
           "missing config attribute 'tp_size'"})
    EXPECT_NE(result.err.find(e), std::string::npos) << e << "\nin: " << result.err;
}

// ---------------------------------------------------------------------------
// Bad input

/// Runs `frag inspect ARGS` with and without --json and expects, each time,
/// exit 1, nothing on stdout and exactly one error line on stderr containing
/// every string of `expected`.
void expect_refused(const std::vector<std::string>& args, const std::vector<std::string>& expected) {
  for (bool json : {false, true}) {
    SCOPED_TRACE(json ? "with --json" : "text");
    auto all = with({"inspect"}, args);
    if (json) all.push_back("--json");
    auto result = frag(all);
    EXPECT_EQ(result.exit_code, 1) << result.err;
    EXPECT_EQ(result.out, "") << "a failing inspect printed a report";
    auto lines = lines_of(result.err);
    ASSERT_EQ(lines.size(), 1u) << "expected one error line, got:\n" << result.err;
    EXPECT_EQ(lines[0].rfind("frag: error: ", 0), 0u) << lines[0];
    for (const auto& e : expected) EXPECT_NE(lines[0].find(e), std::string::npos) << e << "\nin: " << lines[0];
    EXPECT_EQ(result.err.find("Exception raised from"), std::string::npos) << "a LibTorch backtrace leaked";
  }
}

TEST(InspectBadInput, AFileThatIsNotTorchScript) {
  auto folder = temporary_folder();
  write_text(folder + "/model.pt", "this is not a model\n");
  expect_refused({folder + "/model.pt"}, {folder + "/model.pt: not a loadable TorchScript file"});
}

TEST(InspectBadInput, ATruncatedFile) {
  auto folder = temporary_folder();
  const auto source = model_files("llama_tp2")[0];
  std::string bytes = read_text(source);
  ASSERT_GT(bytes.size(), 1000u);
  write_text(folder + "/half.pt", bytes.substr(0, bytes.size() / 2));
  expect_refused({folder + "/half.pt"}, {folder + "/half.pt: not a loadable TorchScript file"});
}

TEST(InspectBadInput, ATruncatedRankAfterAGoodOne) {
  auto folder = temporary_folder();
  const auto files = model_files("llama_tp2");
  std::string bytes = read_text(files[1]);
  write_text(folder + "/rank1.pt", bytes.substr(0, bytes.size() - 100));
  expect_refused({files[0], folder + "/rank1.pt"}, {folder + "/rank1.pt: not a loadable TorchScript file"});
}

TEST(InspectBadInput, RankFilesOfDifferentModels) {
  const auto a = model_files("llama_tp2")[0];
  const auto b = model_files("moe_tp2")[1];
  expect_refused({a, b}, {a, b, "disagree", "11 vs 17 parallel layers"});
}

TEST(InspectBadInput, RankFilesOfDifferentTpSizes) {
  const auto a = model_files("llama_tp2")[0];
  const auto b = model_files("llama_tp4")[1];
  expect_refused({a, b}, {a, b, "disagree", "tp_size 2 vs 4"});
}

TEST(InspectBadInput, RankFilesThatDisagreeOnTheKvLayout) {
  // Same tp size and layer count; only the qkv rule differs (4 vs 2 kv heads).
  const auto a = model_files("llama_tp4")[0];
  const auto b = model_files("llama_kv2_tp4")[1];
  expect_refused({a, b}, {a, b, "disagree", "model.layers.0.self_attn.qkv_proj"});
}

TEST(InspectBadInput, ARulesFileThatDoesNotParse) {
  auto folder = temporary_folder();
  write_text(folder + "/rules.json", "{\"layers\": {\"Foo\": ");
  expect_refused({model_files("llama_tp2")[0], "--rules", folder + "/rules.json"},
                 {folder + "/rules.json: rules file is not valid JSON"});
}

TEST(InspectBadInput, ARulesFileOfTheWrongShape) {
  auto folder = temporary_folder();
  write_text(folder + "/rules.json", R"({"layers": ["RowParallelLinear"]})");
  expect_refused({model_files("llama_tp2")[0], "--rules", folder + "/rules.json"},
                 {folder + "/rules.json: rules file must be an object with \"layers\""});
}

TEST(InspectBadInput, ARulesFileNamingAnUnknownKind) {
  auto folder = temporary_folder();
  write_text(folder + "/rules.json", R"({"layers": {"MyQKV": "QKVParallelLinearX"}})");
  expect_refused({model_files("llama_tp2")[0], "--rules", folder + "/rules.json"},
                 {folder + "/rules.json", "'MyQKV'", "unknown kind \"QKVParallelLinearX\"",
                  "known kinds: ", "QKVParallelLinear"});
}

TEST(InspectBadInput, AMissingRulesFile) {
  auto folder = temporary_folder();
  expect_refused({model_files("llama_tp2")[0], "--rules", folder + "/none.json"},
                 {folder + "/none.json: cannot open the rules file"});
}

TEST(InspectBadInput, AnAlreadyRewrittenFile) {
  auto folder = temporary_folder();
  const auto files = model_files("llama_tp2");
  auto rewrite = frag({"rewrite", files[0], files[1], "-o", folder});
  ASSERT_EQ(rewrite.exit_code, 0) << rewrite.err;
  expect_refused({folder + "/rank0.pt"}, {folder + "/rank0.pt: already rewritten"});
  // Also when only a later rank file is the rewritten one.
  expect_refused({files[0], folder + "/rank1.pt"}, {folder + "/rank1.pt: already rewritten"});
}

TEST(InspectBadInput, AMissingFileIsACommandLineError) {
  auto folder = temporary_folder();
  auto result = frag({"inspect", folder + "/missing.pt"});
  EXPECT_NE(result.exit_code, 0);
  EXPECT_EQ(result.out, "");
  EXPECT_NE(result.err.find(folder + "/missing.pt"), std::string::npos) << result.err;
}

}  // namespace
}  // namespace frag
