// ir/head_layout: the regions must equal python/fragments/local/model.py Model._head_layout's.
#include "ir/head_layout.h"

#include <gtest/gtest.h>

#include <ostream>

namespace frag::ir {

void PrintTo(const HeadRegion& r, std::ostream* os) {
  *os << r.name << "[" << r.start << ":" << r.stop << ", head_dim " << r.head_dim << "]";
}

namespace {

// Head sizes differ (q/k 16, v 8) so that a swapped attribute shows.
const IntAttributes kQkv = {{"total_num_heads", 4}, {"total_num_kv_heads", 2}, {"head_size", 16},
                            {"v_head_size", 8},     {"tp_size", 2},            {"tp_rank", 0}};

LayerEntry layer(const std::string& path, const std::string& kind) { return {path, kind, kind, {}, {}, {}}; }

FragmentTable attention_table() {
  FragmentTable table;
  table.layers = {layer("model.layers.0.self_attn.qkv_proj", "QKVParallelLinear"),
                  layer("model.layers.0.self_attn.o_proj", "RowParallelLinear"),
                  layer("model.layers.0.mlp.down_proj", "RowParallelLinear")};
  return table;
}

IntAttributes attributes_of(const std::string& path) {
  return path == "model.layers.0.self_attn.qkv_proj" ? kQkv : IntAttributes{{"tp_size", 2}};
}

TEST(HeadLayout, QkvOutputIsQThenKThenV) {
  const HeadLayout expected = {{"q", 0, 64, 16}, {"k", 64, 96, 16}, {"v", 96, 112, 8}};
  EXPECT_EQ(qkv_output_heads(kQkv), expected);
  EXPECT_EQ(head_layout(attention_table(), "model.layers.0.self_attn.qkv_proj.output", attributes_of), expected);
  EXPECT_EQ(expected[0].heads(), 4);
  EXPECT_EQ(expected[1].heads(), 2);
  EXPECT_EQ(expected[2].heads(), 2);
}

TEST(HeadLayout, OProjInputIsAllHeadsOfVWidth) {
  const HeadLayout expected = {{"heads", 0, 32, 8}};
  EXPECT_EQ(attention_output_heads(kQkv), expected);
  EXPECT_EQ(head_layout(attention_table(), "model.layers.0.self_attn.o_proj.input", attributes_of), expected);
}

TEST(HeadLayout, OtherLocationsHaveNone) {
  const auto table = attention_table();
  for (const char* location : {"model.layers.0.self_attn.qkv_proj.input", "model.layers.0.self_attn.o_proj.output",
                               "model.layers.0.mlp.down_proj.input", "model.layers.0.output", "nodot"})
    EXPECT_TRUE(head_layout(table, location, attributes_of).empty()) << location;
}

TEST(HeadLayout, MissingOrNonPositiveAttributesGiveNone) {
  for (const char* name : {"total_num_heads", "total_num_kv_heads", "head_size", "v_head_size"}) {
    auto missing = kQkv;
    missing.erase(name);
    EXPECT_TRUE(qkv_output_heads(missing).empty()) << name;
    auto zero = kQkv;
    zero[name] = 0;
    EXPECT_TRUE(qkv_output_heads(zero).empty()) << name;
  }
  auto no_v = kQkv;
  no_v.erase("v_head_size");
  EXPECT_TRUE(attention_output_heads(no_v).empty());
}

TEST(HeadLayout, ARowLayerWithoutAQkvBesideItHasNoHeads) {
  FragmentTable table;
  table.layers = {layer("model.layers.0.self_attn.o_proj", "RowParallelLinear"),
                  layer("model.layers.1.self_attn.qkv_proj", "QKVParallelLinear")};
  EXPECT_TRUE(head_layout(table, "model.layers.0.self_attn.o_proj.input", attributes_of).empty());
}

}  // namespace
}  // namespace frag::ir
