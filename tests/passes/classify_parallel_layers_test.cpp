//===- tests/passes/classify_parallel_layers_test.cpp - Which sides are sharded ===//
//
// classify_parallel_layers against every row of fragment-rules.md ("Per
// layer"), including the layers and configs that are NOT fragmented; class
// name demangling and user aliases; errors a user can act on (missing or
// mistyped config attributes, inconsistent sizes, tables that disagree); and
// rank independence.
//
//===----------------------------------------------------------------------===//
#include "passes/classify_parallel_layers.h"

#include "ir/error.h"
#include "ir/fragment_rule.h"
#include "ir/fragment_table.h"
#include "tests/passes/pass_fixtures.h"
#include "tests/support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace frag::passes {
namespace {

using namespace frag::passes::testing;
using ir::FragmentRule;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

constexpr const char* kSource = "rank0.pt";

/// A root with `layer` at the dotted `path` (intermediate modules made up).
Module root_with(const std::string& path, const Module& layer) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    parts.push_back(path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  Module child = layer;
  for (size_t i = parts.size() - 1; i > 0; --i) {
    Module parent = make_module("__torch__.Container" + std::to_string(i));
    parent.register_module(parts[i], child);
    child = parent;
  }
  Module root = make_module("__torch__.Root");
  root.register_module(parts[0], child);
  return root;
}

ir::FragmentTable classify(const Module& root, const LayerAliases& aliases = {}) {
  return classify_parallel_layers(root, aliases, kSource);
}

/// Classifies `layer` placed at `path` and returns its (only) entry.
ir::LayerEntry classify_one(const Module& layer, const std::string& path = "layer",
                            ir::FragmentTable* table_out = nullptr) {
  auto table = classify(root_with(path, layer));
  EXPECT_EQ(table.layers.size(), 1u);
  if (table_out != nullptr) *table_out = table;
  if (table.layers.empty()) return {};
  EXPECT_EQ(table.layers[0].path, path);
  return table.layers[0];
}

/// A copy of `m` (same class name, new type) without attribute `skip`.
Module without(const Module& m, const std::string& skip) {
  Module out = make_module(m.type()->name()->qualifiedName());
  auto type = m.type();
  for (size_t i = 0; i < type->numAttributes(); ++i) {
    const std::string name = type->getAttributeName(i);
    if (name == skip) continue;
    auto value = m._ivalue()->getSlot(i);
    if (type->is_parameter(i))
      out.register_parameter(name, value.toTensor(), false);
    else
      out.register_attribute(name, type->getAttribute(i), value);
  }
  return out;
}

/// A copy of `m` whose attribute `name` has type `type` and value `value`.
Module with_attr(const Module& m, const std::string& name, const c10::TypePtr& type,
                 const c10::IValue& value) {
  Module out = without(m, name);
  out.register_attribute(name, type, value);
  return out;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const frag::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no frag::Error thrown";
  return "";
}

std::string classify_error(const Module& layer, const std::string& path = "model.layers.0.proj") {
  return error_of([&] { classify(root_with(path, layer)); });
}

// ----- names and kinds --------------------------------------------------------

TEST(PlainClassName, StripsPrefixAndMangling) {
  EXPECT_EQ(plain_class_name("__torch__.fragkit.layers.___torch_mangle_3.QKVParallelLinear"),
            "QKVParallelLinear");
  EXPECT_EQ(plain_class_name("__torch__.x.___torch_mangle_7.RowParallelLinear"), "RowParallelLinear");
  EXPECT_EQ(plain_class_name("__torch__.fragkit.layers.FusedMoE"), "FusedMoE");
  EXPECT_EQ(plain_class_name("__torch__.___torch_mangle_12.Block"), "Block");
  EXPECT_EQ(plain_class_name("Plain"), "Plain");
}

TEST(KnownLayerKinds, EveryRowOfTheReference) {
  EXPECT_THAT(known_layer_kinds(),
              ::testing::UnorderedElementsAre("ReplicatedLinear", "ColumnParallelLinear",
                                              "MergedColumnParallelLinear", "QKVParallelLinear",
                                              "RowParallelLinear", "VocabParallelEmbedding",
                                              "ParallelLMHead", "LogitsProcessor", "FusedMoE"));
}

TEST(Classify, MangledClassNamesAreRecognized) {
  auto entry = classify_one(row(2, 0, 16, 8, true, false, "__torch__.x.___torch_mangle_7.RowParallelLinear"),
                            "down_proj");
  EXPECT_EQ(entry.kind, "RowParallelLinear");
  EXPECT_EQ(entry.class_name, "RowParallelLinear");
  ASSERT_TRUE(entry.input.has_value());
  EXPECT_EQ(entry.input->rule, FragmentRule::shard(-1, "tp", 2));
}

TEST(Classify, OtherModulesAreNotLayers) {
  Module root = holder({{"act", plain("__torch__.Act", "def forward(self, x):\n    return x\n")},
                        {"norm", plain("__torch__.RMSNorm", "def forward(self, x):\n    return x\n")}});
  auto table = classify(root);
  EXPECT_THAT(table.layers, IsEmpty());
  EXPECT_EQ(table.tp_size, 1);
}

// ----- ColumnParallelLinear ---------------------------------------------------

TEST(Classify, ColumnOutputIsShardedOnTheLastDim) {
  ir::FragmentTable table;
  auto entry = classify_one(column(4, 1, 32, 64), "mlp.up_proj", &table);
  EXPECT_EQ(entry.kind, "ColumnParallelLinear");
  EXPECT_EQ(entry.class_name, "ColumnParallelLinear");
  EXPECT_FALSE(entry.input.has_value());
  ASSERT_TRUE(entry.output.has_value());
  EXPECT_EQ(entry.output->rule, FragmentRule::shard(-1, "tp", 4));
  EXPECT_EQ(entry.output->whole_width, 64);  // output_size
  EXPECT_EQ(table.tp_size, 4);
  EXPECT_EQ(table.rule_at("mlp.up_proj.output"), &table.layers[0].output->rule);
  EXPECT_EQ(table.rule_at("mlp.up_proj.input"), nullptr);
}

TEST(Classify, ColumnGatheringItsOutputIsNotFragmented) {
  auto entry = classify_one(column(2, 0, 32, 64, /*gather_output=*/true));
  EXPECT_FALSE(entry.input.has_value());
  EXPECT_FALSE(entry.output.has_value());
  EXPECT_THAT(entry.notes, Contains(HasSubstr("gather_output=True")));
}

TEST(Classify, ColumnAtTpOneIsNotFragmented) {
  ir::FragmentTable table;
  auto entry = classify_one(column(1, 0, 32, 64), "layer", &table);
  EXPECT_FALSE(entry.input.has_value());
  EXPECT_FALSE(entry.output.has_value());
  EXPECT_THAT(entry.notes, Contains(HasSubstr("tp_size=1")));
  EXPECT_EQ(table.tp_size, 1);
}

// ----- MergedColumnParallelLinear -------------------------------------------

TEST(Classify, MergedGateUpIsSegmentsNamedGateAndUp) {
  auto entry = classify_one(merged(2, 0, 16, {64, 64}), "model.layers.0.mlp.gate_up_proj");
  EXPECT_EQ(entry.kind, "MergedColumnParallelLinear");
  ASSERT_TRUE(entry.output.has_value());
  EXPECT_EQ(entry.output->rule, FragmentRule::segments({64, 64}, {"gate", "up"}, "tp", 2));
  EXPECT_EQ(entry.output->whole_width, 128);
  EXPECT_FALSE(entry.input.has_value());
}

TEST(Classify, MergedOfThreePartsHasNoNames) {
  auto entry = classify_one(merged(2, 1, 16, {32, 64, 96}), "mlp.fused_proj");
  ASSERT_TRUE(entry.output.has_value());
  EXPECT_EQ(entry.output->rule, FragmentRule::segments({32, 64, 96}, {}, "tp", 2));
  EXPECT_EQ(entry.output->whole_width, 192);
}

TEST(Classify, MergedOfTwoPartsElsewhereHasNoNames) {
  auto entry = classify_one(merged(2, 0, 16, {64, 64}), "mlp.kv_proj");
  ASSERT_TRUE(entry.output.has_value());
  EXPECT_EQ(entry.output->rule, FragmentRule::segments({64, 64}, {}, "tp", 2));
}

// ----- QKVParallelLinear ------------------------------------------------------

struct QkvCase {
  int64_t tp, heads, kv_heads, head_size, v_head_size;
  int64_t replicas, whole_width;
};

TEST(Classify, QkvHeadsReplicasAndWholeWidth) {
  const std::vector<QkvCase> cases = {
      {4, 8, 2, 16, 16, /*replicas=*/2, /*whole=*/8 * 16 + 2 * (16 + 16)},  // GQA, kv replicated
      {8, 8, 1, 16, 16, 8, 8 * 16 + 1 * (16 + 16)},                         // MQA at tp 8
      {2, 32, 8, 8, 4, 1, 32 * 8 + 8 * (8 + 4)},                            // 4 kv heads per rank
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.heads << "q/" << c.kv_heads << "kv at tp " << c.tp);
    Module layer = qkv(c.tp, 0, 32, c.head_size, c.heads, c.kv_heads, c.v_head_size);
    auto entry = classify_one(layer, "self_attn.qkv_proj");
    EXPECT_EQ(entry.kind, "QKVParallelLinear");
    EXPECT_FALSE(entry.input.has_value());
    ASSERT_TRUE(entry.output.has_value());
    EXPECT_EQ(entry.output->rule,
              FragmentRule::qkv(c.heads, c.kv_heads, c.head_size, c.v_head_size, "tp", c.tp));
    EXPECT_EQ(entry.output->rule.kv_replicas(), c.replicas);
    // Hq·hs + Hkv·(hs + vs), not vLLM's output_size (which counts the replicas).
    EXPECT_EQ(entry.output->whole_width, c.whole_width);
    const int64_t vllm_output_size = layer.attr("output_size").toInt();
    if (c.replicas > 1)
      EXPECT_GT(vllm_output_size, c.whole_width);
    else
      EXPECT_EQ(vllm_output_size, c.whole_width);
  }
}

// ----- RowParallelLinear ------------------------------------------------------

TEST(Classify, RowParallelInputAndPartialOutput) {
  auto entry = classify_one(row(2, 0, 64, 16, /*input_is_parallel=*/true, /*reduce_results=*/false),
                            "mlp.down_proj");
  EXPECT_EQ(entry.kind, "RowParallelLinear");
  ASSERT_TRUE(entry.input.has_value());
  EXPECT_EQ(entry.input->rule, FragmentRule::shard(-1, "tp", 2));
  EXPECT_EQ(entry.input->whole_width, 64);  // input_size
  ASSERT_TRUE(entry.output.has_value());
  EXPECT_EQ(entry.output->rule, FragmentRule::partial_sum("tp", 2));
  EXPECT_EQ(entry.output->whole_width, 16);  // output_size
}

TEST(Classify, RowWithWholeInputAndReducedOutputIsNotFragmented) {
  auto entry = classify_one(row(2, 1, 64, 16, /*input_is_parallel=*/false, /*reduce_results=*/true));
  EXPECT_FALSE(entry.input.has_value());
  EXPECT_FALSE(entry.output.has_value());
  EXPECT_THAT(entry.notes, Contains(HasSubstr("input_is_parallel=False")));
  EXPECT_THAT(entry.notes, Contains(HasSubstr("reduce_results=True")));
}

TEST(Classify, RowSidesAreDecidedIndependently) {
  auto in_only = classify_one(row(2, 0, 64, 16, true, true));
  EXPECT_TRUE(in_only.input.has_value());
  EXPECT_FALSE(in_only.output.has_value());
  auto out_only = classify_one(row(2, 0, 64, 16, false, false));
  EXPECT_FALSE(out_only.input.has_value());
  ASSERT_TRUE(out_only.output.has_value());
  EXPECT_EQ(out_only.output->rule, FragmentRule::partial_sum("tp", 2));
}

TEST(Classify, RowAtTpOneIsNotFragmented) {
  auto entry = classify_one(row(1, 0, 64, 16, true, false));
  EXPECT_FALSE(entry.input.has_value());
  EXPECT_FALSE(entry.output.has_value());
  EXPECT_THAT(entry.notes, Contains(HasSubstr("tp_size=1")));
}

// ----- replicated / vocab layers ---------------------------------------------

TEST(Classify, ReplicatedLinearIsNeverFragmented) {
  auto entry = classify_one(replicated(16, 8), "mlp.gate");
  EXPECT_EQ(entry.kind, "ReplicatedLinear");
  EXPECT_FALSE(entry.input.has_value());
  EXPECT_FALSE(entry.output.has_value());
  EXPECT_THAT(entry.notes, Not(IsEmpty()));
}

TEST(Classify, VocabParallelEmbeddingIsNotFragmented) {
  auto entry = classify_one(vocab_embedding(2, 1, 1000, 8), "model.embed_tokens");
  EXPECT_EQ(entry.kind, "VocabParallelEmbedding");
  EXPECT_FALSE(entry.input.has_value());
  EXPECT_FALSE(entry.output.has_value());
  EXPECT_THAT(entry.notes, Not(IsEmpty()));
}

TEST(Classify, ParallelLmHeadOutputIsAPaddedVocabShard) {
  for (auto [vocab, padded] : {std::pair<int64_t, int64_t>{1000, 1024}, {32001, 32064}}) {
    SCOPED_TRACE(vocab);
    auto entry = classify_one(lm_head(2, 0, vocab, 8), "lm_head");
    EXPECT_EQ(entry.kind, "ParallelLMHead");
    EXPECT_FALSE(entry.input.has_value());
    ASSERT_TRUE(entry.output.has_value());
    EXPECT_EQ(entry.output->rule, FragmentRule::vocab_shard(vocab, padded, "tp", 2));
    EXPECT_EQ(entry.output->whole_width, vocab);
  }
}

TEST(Classify, ParallelLmHeadAtTpOne) {
  // Padded: still a vocab shard (over one rank), so the whole is the org vocab at every tp size.
  auto padded = classify_one(lm_head(1, 0, 1000, 8), "lm_head");
  EXPECT_FALSE(padded.input.has_value());
  ASSERT_TRUE(padded.output.has_value());
  EXPECT_EQ(padded.output->rule, FragmentRule::vocab_shard(1000, 1024, "tp", 1));
  // Not padded: nothing to do.
  auto exact = classify_one(lm_head(1, 0, 1024, 8), "lm_head");
  EXPECT_FALSE(exact.input.has_value());
  EXPECT_FALSE(exact.output.has_value());
  EXPECT_THAT(exact.notes, Contains(HasSubstr("tp_size=1")));
}

TEST(Classify, LogitsProcessorInputIsAPaddedVocabShard) {
  for (auto [vocab, padded] : {std::pair<int64_t, int64_t>{1000, 1024}, {32001, 32064}}) {
    SCOPED_TRACE(vocab);
    auto entry = classify_one(logits_processor(2, vocab), "logits_processor");
    EXPECT_EQ(entry.kind, "LogitsProcessor");
    ASSERT_TRUE(entry.input.has_value());
    EXPECT_EQ(entry.input->rule, FragmentRule::vocab_shard(vocab, padded, "tp", 2));
    EXPECT_EQ(entry.input->whole_width, vocab);
    EXPECT_FALSE(entry.output.has_value());  // it gathers and drops the padding itself
  }
}

TEST(Classify, LogitsProcessorAtTpOne) {
  auto padded = classify_one(logits_processor(1, 1000), "logits_processor");
  ASSERT_TRUE(padded.input.has_value());
  EXPECT_EQ(padded.input->rule, FragmentRule::vocab_shard(1000, 1024, "tp", 1));
  EXPECT_FALSE(padded.output.has_value());
  auto exact = classify_one(logits_processor(1, 1024), "logits_processor");
  EXPECT_FALSE(exact.input.has_value());
  EXPECT_FALSE(exact.output.has_value());
}

TEST(Classify, LmHeadAndLogitsProcessorAgreeOnTheRule) {
  Module root = holder({{"lm_head", lm_head(4, 0, 32001, 8)}, {"logits_processor", logits_processor(4, 32001)}});
  auto table = classify(root);
  ASSERT_NE(table.rule_at("lm_head.output"), nullptr);
  ASSERT_NE(table.rule_at("logits_processor.input"), nullptr);
  EXPECT_EQ(*table.rule_at("lm_head.output"), *table.rule_at("logits_processor.input"));
}

// ----- FusedMoE --------------------------------------------------------------

TEST(Classify, FusedMoePartialSumSpansTpTimesEp) {
  {
    ir::FragmentTable table;
    auto entry = classify_one(fused_moe(2, 1, 1, 0, 8, 16, 32, /*reduce_results=*/false), "mlp.experts",
                              &table);
    EXPECT_EQ(entry.kind, "FusedMoE");
    EXPECT_FALSE(entry.input.has_value());
    ASSERT_TRUE(entry.output.has_value());
    EXPECT_EQ(entry.output->rule, FragmentRule::partial_sum(ir::kTpEpGroup, 2));
    EXPECT_EQ(entry.output->rule.group, "tp×ep");
    EXPECT_EQ(entry.output->whole_width, 16);  // hidden_size
    EXPECT_EQ(table.tp_size, 2);
  }
  {
    ir::FragmentTable table;
    auto entry = classify_one(fused_moe(1, 0, 4, 3, 8, 16, 32, /*reduce_results=*/false), "mlp.experts",
                              &table);
    ASSERT_TRUE(entry.output.has_value());
    EXPECT_EQ(entry.output->rule, FragmentRule::partial_sum(ir::kTpEpGroup, 4));
    EXPECT_EQ(table.tp_size, 4);
  }
}

TEST(Classify, FusedMoeReducingItselfIsNotFragmented) {
  auto entry = classify_one(fused_moe(2, 0, 1, 0, 8, 16, 32, /*reduce_results=*/true), "mlp.experts");
  EXPECT_FALSE(entry.input.has_value());
  EXPECT_FALSE(entry.output.has_value());
  EXPECT_THAT(entry.notes, Contains(HasSubstr("reduce_results=True")));
  auto single = classify_one(fused_moe(1, 0, 1, 0, 8, 16, 32, false), "mlp.experts");
  EXPECT_FALSE(single.output.has_value());
}

// ----- aliases ---------------------------------------------------------------

/// `text` in a file `name` of a folder of this process's own (removed at its exit: test_support.h).
std::string temp_file(const std::string& name, const std::string& text) {
  static const std::string folder = frag::testing::temporary_folder();
  const std::string path = folder + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(LayerAliases, DeclaredClassIsClassifiedAsItsKind) {
  const std::string path = temp_file("aliases.json", R"({"layers": {"MyQKV": "QKVParallelLinear"}})");
  auto aliases = LayerAliases::from_file(path);
  EXPECT_EQ(aliases.kind_of_class.at("MyQKV"), "QKVParallelLinear");
  Module root = root_with("attn.qkv", qkv(4, 0, 32, 16, 8, 2, 16, "__torch__.user.___torch_mangle_2.MyQKV"));
  auto table = classify(root, aliases);
  ASSERT_EQ(table.layers.size(), 1u);
  EXPECT_EQ(table.layers[0].class_name, "MyQKV");
  EXPECT_EQ(table.layers[0].kind, "QKVParallelLinear");
  ASSERT_TRUE(table.layers[0].output.has_value());
  EXPECT_EQ(table.layers[0].output->rule, FragmentRule::qkv(8, 2, 16, 16, "tp", 4));
  // Without the alias the class is unknown: no layer.
  EXPECT_THAT(classify(root).layers, IsEmpty());
}

TEST(LayerAliases, BadFilesNameTheFile) {
  struct BadCase {
    std::string name, text, expected;
  };
  const std::vector<BadCase> cases = {
      {"unparsable.json", "{\"layers\": {", "not valid JSON"},
      {"unknown_kind.json", R"({"layers": {"MyLinear": "FancyParallelLinear"}})", "FancyParallelLinear"},
      {"kind_not_string.json", R"({"layers": {"MyLinear": 3}})", "MyLinear"},
      {"layers_array.json", R"({"layers": ["MyLinear"]})", "\"layers\""},
      {"top_array.json", R"([{"MyLinear": "RowParallelLinear"}])", "\"layers\""},
      {"no_layers.json", R"({"MyLinear": "RowParallelLinear"})", "\"layers\""},
      // Merged read as plain column would take [gate_r|up_r] for one shard: refused, not a silent layout.
      {"redeclared.json", R"({"layers": {"MergedColumnParallelLinear": "ColumnParallelLinear"}})",
       "class 'MergedColumnParallelLinear' is a kind frag knows; a rules file declares new classes only"},
      // Issue 16: an empty class name was accepted silently, an empty kind reported as 'unknown kind ""'.
      {"empty_class.json", R"({"layers": {"": "RowParallelLinear"}})",
       "\"layers\" has an empty class name (declared as \"RowParallelLinear\"): expected the Python class name"},
      {"empty_kind.json", R"({"layers": {"MyLinear": ""}})",
       "class 'MyLinear' is declared as \"\" (empty): expected one of the known kinds ReplicatedLinear, "},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = temp_file(c.name, c.text);
    const std::string message = error_of([&] { LayerAliases::from_file(path); });
    EXPECT_THAT(message, HasSubstr(path));
    EXPECT_THAT(message, HasSubstr(c.expected));
  }
  const std::string missing = ::testing::TempDir() + "/no_such_rules.json";
  EXPECT_THAT(error_of([&] { LayerAliases::from_file(missing); }), HasSubstr(missing));
}

// ----- errors ----------------------------------------------------------------

struct MissingCase {
  const char* kind;
  const char* attribute;
  Module layer;
};

std::vector<MissingCase> missing_cases() {
  return {
      {"ColumnParallelLinear", "tp_size", column(2, 0, 8, 16)},
      {"ColumnParallelLinear", "tp_rank", column(2, 0, 8, 16)},
      {"ColumnParallelLinear", "output_size", column(2, 0, 8, 16)},
      {"ColumnParallelLinear", "gather_output", column(2, 0, 8, 16)},
      {"MergedColumnParallelLinear", "output_sizes", merged(2, 0, 8, {16, 16})},
      {"QKVParallelLinear", "total_num_heads", qkv(2, 0, 8, 4, 4, 2)},
      {"QKVParallelLinear", "total_num_kv_heads", qkv(2, 0, 8, 4, 4, 2)},
      {"QKVParallelLinear", "head_size", qkv(2, 0, 8, 4, 4, 2)},
      {"QKVParallelLinear", "v_head_size", qkv(2, 0, 8, 4, 4, 2)},
      {"RowParallelLinear", "input_size", row(2, 0, 16, 8, true, false)},
      {"RowParallelLinear", "input_is_parallel", row(2, 0, 16, 8, true, false)},
      {"RowParallelLinear", "reduce_results", row(2, 0, 16, 8, true, false)},
      {"RowParallelLinear", "output_size", row(2, 0, 16, 8, true, false)},
      {"VocabParallelEmbedding", "num_embeddings_padded", vocab_embedding(2, 0, 100, 8)},
      {"ParallelLMHead", "org_vocab_size", lm_head(2, 0, 100, 8)},
      {"ParallelLMHead", "num_embeddings_padded", lm_head(2, 0, 100, 8)},
      {"LogitsProcessor", "vocab_size", logits_processor(2, 100)},
      {"LogitsProcessor", "org_vocab_size", logits_processor(2, 100)},
      {"LogitsProcessor", "tp_size", logits_processor(2, 100)},
      {"FusedMoE", "ep_size", fused_moe(2, 0, 1, 0, 4, 8, 16, false)},
      {"FusedMoE", "ep_rank", fused_moe(2, 0, 1, 0, 4, 8, 16, false)},
      {"FusedMoE", "intermediate_size", fused_moe(2, 0, 1, 0, 4, 8, 16, false)},
      {"FusedMoE", "reduce_results", fused_moe(2, 0, 1, 0, 4, 8, 16, false)},
      {"FusedMoE", "hidden_size", fused_moe(2, 0, 1, 0, 4, 8, 16, false)},
  };
}

TEST(ClassifyErrors, MissingConfigAttributeNamesSourcePathClassAndAttribute) {
  for (const auto& c : missing_cases()) {
    SCOPED_TRACE(std::string(c.kind) + " without " + c.attribute);
    const std::string message = classify_error(without(c.layer, c.attribute), "model.layers.0.proj");
    EXPECT_THAT(message, HasSubstr(kSource));
    EXPECT_THAT(message, HasSubstr("model.layers.0.proj"));
    EXPECT_THAT(message, HasSubstr(c.kind));
    EXPECT_THAT(message, HasSubstr(std::string("'") + c.attribute + "'"));
    EXPECT_THAT(message, HasSubstr("missing"));
  }
}

TEST(ClassifyErrors, WrongAttributeType) {
  struct Case {
    Module layer;
    const char* attribute;
    const char* expected;
  };
  const std::vector<Case> cases = {
      {with_attr(column(2, 0, 8, 16), "gather_output", c10::IntType::get(), int64_t{0}), "gather_output", "bool"},
      {with_attr(column(2, 0, 8, 16), "tp_size", c10::BoolType::get(), true), "tp_size", "int"},
      {with_attr(merged(2, 0, 8, {16, 16}), "output_sizes", c10::IntType::get(), int64_t{32}), "output_sizes",
       "List[int]"},
      {with_attr(row(2, 0, 16, 8), "reduce_results", c10::IntType::get(), int64_t{1}), "reduce_results", "bool"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.attribute);
    const std::string message = classify_error(c.layer, "proj");
    EXPECT_THAT(message, HasSubstr(kSource));
    EXPECT_THAT(message, HasSubstr("proj"));
    EXPECT_THAT(message, HasSubstr(std::string("'") + c.attribute + "'"));
    EXPECT_THAT(message, HasSubstr(c.expected));
  }
}

TEST(ClassifyErrors, InconsistentSizes) {
  struct Case {
    std::string what;
    Module layer;
    std::string expected;
  };
  Module merged_bad_sum = merged(2, 0, 8, {16, 16});
  merged_bad_sum.setattr("output_size", int64_t{40});
  Module column_whole_weight = column(2, 0, 8, 16);
  column_whole_weight.setattr("weight", torch::zeros({16, 8}));
  Module row_whole_weight = row(2, 0, 16, 8);
  row_whole_weight.setattr("weight", torch::zeros({8, 16}));
  Module qkv_whole_weight = qkv(4, 0, 32, 16, 8, 2);
  qkv_whole_weight.setattr("weight", torch::zeros({192, 32}));
  const std::vector<Case> cases = {
      {"q heads not divisible by tp", qkv(4, 0, 32, 16, 6, 2), "total_num_heads 6 is not divisible by tp_size 4"},
      {"kv heads neither divide nor divisible", qkv(2, 0, 32, 16, 6, 3), "total_num_kv_heads 3"},
      {"output_sizes do not sum", merged_bad_sum, "output_sizes sum to 32 but output_size is 40"},
      {"output_sizes entry not divisible", merged(4, 0, 8, {6, 10}),
       "an entry of output_sizes = 6 is not divisible by tp_size 4"},
      {"column weight rows", column_whole_weight, "weight has 16 rows, expected 8"},
      {"row weight columns", row_whole_weight, "weight has 16 columns, expected 8"},
      {"qkv weight rows", qkv_whole_weight, "weight has 192 rows, expected 64"},
      {"column width not divisible", column(4, 0, 8, 18), "output_size = 18 is not divisible by tp_size 4"},
      {"tp_rank out of range", column(2, 2, 8, 16), "tp_rank 2 is outside [0, 2)"},
      {"moe tp and ep both", fused_moe(2, 0, 2, 0, 4, 8, 16, false), "both above 1"},
      {"padded vocab not divisible", lm_head(3, 0, 100, 8), "num_embeddings_padded = 128 is not divisible by tp_size 3"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string message = classify_error(c.layer, "model.layers.3.proj");
    EXPECT_THAT(message, HasSubstr(kSource));
    EXPECT_THAT(message, HasSubstr("model.layers.3.proj"));
    EXPECT_THAT(message, HasSubstr(c.expected));
  }
}

TEST(ClassifyErrors, LayersSpanningDifferentGroupSizes) {
  Module root = holder({{"a", column(2, 0, 8, 16)}, {"b", column(4, 0, 8, 16)}});
  const std::string message = error_of([&] { classify(root); });
  EXPECT_THAT(message, HasSubstr(kSource));
  EXPECT_THAT(message, HasSubstr("spans 4 ranks but earlier layers span 2"));
  // A tp_size 1 layer (vLLM's disable_tp) is allowed next to sharded ones.
  Module mixed = holder({{"a", column(2, 0, 8, 16)}, {"gate", column(1, 0, 8, 16)}});
  EXPECT_EQ(classify(mixed).tp_size, 2);
}

// ----- tables of several rank files ------------------------------------------

/// A model with every layer kind at `rank` of tp 2.
Module every_kind(int64_t rank, bool down_reduces = false) {
  Module mlp = holder({{"gate_up_proj", merged(2, rank, 16, {32, 32})},
                       {"down_proj", row(2, rank, 32, 16, true, down_reduces)}},
                      "__torch__.Mlp");
  Module attn = holder({{"qkv_proj", qkv(2, rank, 16, 4, 4, 2)}, {"o_proj", row(2, rank, 16, 16, true, true)}},
                       "__torch__.Attn");
  return holder({{"embed_tokens", vocab_embedding(2, rank, 100, 16)},
                 {"attn", attn},
                 {"mlp", mlp},
                 {"up", column(2, rank, 16, 32)},
                 {"gate", replicated(16, 4)},
                 {"experts", fused_moe(2, rank, 1, 0, 4, 16, 32, false)},
                 {"lm_head", lm_head(2, rank, 100, 16)},
                 {"logits_processor", logits_processor(2, 100)}});
}

TEST(RankIndependence, SameLayerAtEveryRankGivesEqualTables) {
  auto table0 = classify(every_kind(0));
  auto table1 = classify_parallel_layers(every_kind(1), {}, "rank1.pt");
  EXPECT_EQ(table0.layers.size(), 10u);
  EXPECT_EQ(ir::to_json(table0), ir::to_json(table1));  // notes included
  EXPECT_NO_THROW(check_tables_agree({"rank0.pt", "rank1.pt"}, {table0, table1}));
  // Every layer kind of the reference shows up.
  std::vector<std::string> kinds;
  for (const auto& layer : table0.layers) kinds.push_back(layer.kind);
  for (const auto& kind : known_layer_kinds()) EXPECT_THAT(kinds, Contains(kind));
}

TEST(RankIndependence, SingleColumnAtRanksZeroAndOne) {
  auto a = classify_one(column(2, 0, 8, 16), "up");
  auto b = classify_one(column(2, 1, 8, 16), "up");
  EXPECT_TRUE(a == b);
  ASSERT_TRUE(a.output && b.output);
  EXPECT_EQ(a.output->rule, b.output->rule);
  EXPECT_EQ(a.output->whole_width, b.output->whole_width);
}

TEST(CheckTablesAgree, DifferingTablesNameBothSources) {
  auto rank0 = classify(every_kind(0, /*down_reduces=*/false));
  auto rank1 = classify(every_kind(1, /*down_reduces=*/true));
  const std::string message =
      error_of([&] { check_tables_agree({"rank0.pt", "rank1.pt"}, {rank0, rank1}); });
  EXPECT_THAT(message, HasSubstr("rank0.pt"));
  EXPECT_THAT(message, HasSubstr("rank1.pt"));
  EXPECT_THAT(message, HasSubstr("mlp.down_proj"));
  EXPECT_THAT(message, HasSubstr("output partial sum over tp = 2 vs"));
  EXPECT_THAT(message, HasSubstr("output whole"));
}

TEST(CheckTablesAgree, LaterRankThatDiffersIsNamed) {
  auto t0 = classify(every_kind(0));
  auto t1 = classify(every_kind(1));
  auto t2 = classify(holder({{"up", column(4, 2, 16, 32)}}));
  const std::string message =
      error_of([&] { check_tables_agree({"r0.pt", "r1.pt", "r2.pt"}, {t0, t1, t2}); });
  EXPECT_THAT(message, HasSubstr("r0.pt"));
  EXPECT_THAT(message, HasSubstr("r2.pt"));
  EXPECT_THAT(message, Not(HasSubstr("r1.pt")));
}

TEST(CheckTablesAgree, DifferentLayerCountsOrTpSizes) {
  auto two = classify(holder({{"a", column(2, 0, 8, 16)}, {"b", column(2, 0, 8, 16)}}));
  auto one = classify(holder({{"a", column(2, 1, 8, 16)}}));
  EXPECT_THAT(error_of([&] { check_tables_agree({"x.pt", "y.pt"}, {two, one}); }),
              AllOf(HasSubstr("x.pt"), HasSubstr("y.pt"), HasSubstr("2 vs 1")));
  auto tp4 = classify(holder({{"a", column(4, 0, 8, 16)}, {"b", column(4, 0, 8, 16)}}));
  EXPECT_THAT(error_of([&] { check_tables_agree({"x.pt", "y.pt"}, {two, tp4}); }),
              AllOf(HasSubstr("x.pt"), HasSubstr("y.pt"), HasSubstr("tp_size 2 vs 4")));
}

TEST(CheckTablesAgree, AnInputSideDifferenceIsReported) {
  // Same output rule, different input side.
  auto a = classify(holder({{"down", row(2, 0, 16, 8, /*input_is_parallel=*/true, false)}}));
  auto b = classify(holder({{"down", row(2, 1, 16, 8, /*input_is_parallel=*/false, false)}}));
  const std::string message = error_of([&] { check_tables_agree({"a.pt", "b.pt"}, {a, b}); });
  EXPECT_THAT(message, HasSubstr("a.pt"));
  EXPECT_THAT(message, HasSubstr("b.pt"));
  EXPECT_THAT(message, HasSubstr("down"));
}

}  // namespace
}  // namespace frag::passes
