//===- tests/ir/location_table_test.cpp - Every location indexed once ===//
#include "ir/location_table.h"

#include "ir/error.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace frag::ir {
namespace {

using ::testing::HasSubstr;

FragmentTable two_layer_table() {
  FragmentTable table;
  table.tp_size = 2;
  LayerEntry up{"model.layers.0.mlp.up_proj", "ColumnParallelLinear", "ColumnParallelLinear", std::nullopt,
                FragmentedSide{FragmentRule::shard(-1, kTpGroup, 2), 128}, {}};
  LayerEntry down{"model.layers.0.mlp.down_proj", "RowParallelLinear", "RowParallelLinear",
                  FragmentedSide{FragmentRule::shard(-1, kTpGroup, 2), 128}, std::nullopt, {}};
  table.layers = {up, down};
  table.whole = {"model.layers.0.mlp.up_proj.input", "model.layers.0.output"};
  table.rank_local = {{"model.layers.0.mlp.act_fn.output", "model.layers.0.mlp.up_proj.output"}};
  return table;
}

TEST(LocationTable, IdsFollowTheTableFragmentedFirst) {
  const LocationTable locations(two_layer_table());
  ASSERT_EQ(locations.size(), 5u);
  EXPECT_EQ(locations.at(0).name, "model.layers.0.mlp.up_proj.output");
  EXPECT_EQ(locations.at(1).name, "model.layers.0.mlp.down_proj.input");
  EXPECT_EQ(locations.at(2).name, "model.layers.0.mlp.up_proj.input");
  EXPECT_EQ(locations.at(4).kind, LocationKind::kRankLocal);
  EXPECT_EQ(locations.at(4).derived_from, "model.layers.0.mlp.up_proj.output");
  for (LocationId id = 0; id < static_cast<LocationId>(locations.size()); ++id)
    EXPECT_EQ(locations.find(locations.at(id).name), id);
  ASSERT_TRUE(locations.at(0).side.has_value());
  EXPECT_EQ(locations.at(0).side->whole_width, 128);
  EXPECT_EQ(locations.at(2).side, std::nullopt);
  EXPECT_EQ(locations.kind_of("model.layers.0.output"), LocationKind::kWhole);
  EXPECT_EQ(locations.kind_of("model.layers.7.output"), LocationKind::kUnknown);
  EXPECT_NE(locations.side_at("model.layers.0.mlp.down_proj.input"), nullptr);
  EXPECT_EQ(locations.side_at("model.layers.0.output"), nullptr);
  ASSERT_NE(locations.layer("model.layers.0.mlp.down_proj"), nullptr);
  EXPECT_EQ(locations.layer("model.layers.0.mlp.down_proj")->kind, "RowParallelLinear");
  EXPECT_EQ(locations.layer("model.layers.0.mlp"), nullptr);
}

TEST(LocationTable, GroupsAreBoundToIdsAtLoad) {
  FragmentTable table = two_layer_table();
  table.layers[1].input->rule = FragmentRule::shard(-1, kTpEpGroup, 2);
  LayerEntry odd{"model.layers.0.odd", "ColumnParallelLinear", "ColumnParallelLinear", std::nullopt,
                 FragmentedSide{FragmentRule::shard(-1, "pp", 2), 128}, {}};
  table.layers.push_back(odd);
  const LocationTable locations(table);
  EXPECT_EQ(locations.at(0).group, GroupId::kTp);
  EXPECT_EQ(locations.at(1).group, GroupId::kTpEp);
  EXPECT_EQ(locations.at(*locations.find("model.layers.0.odd.output")).group, std::nullopt);  // no such group
  EXPECT_EQ(locations.at(*locations.find("model.layers.0.output")).group, std::nullopt);      // whole
  for (size_t i = 0; i < kGroupCount; ++i) {
    const auto id = static_cast<GroupId>(i);
    EXPECT_EQ(group_id(group_name(id)), id);
  }
  EXPECT_EQ(group_id("tp "), std::nullopt);
}

TEST(LocationTable, EqualTablesGiveEqualIds) {
  const LocationTable a(two_layer_table()), b(two_layer_table());
  for (LocationId id = 0; id < static_cast<LocationId>(a.size()); ++id) EXPECT_EQ(a.at(id).name, b.at(id).name);
}

TEST(LocationTable, AnUnknownNameSuggestsTheClosest) {
  const LocationTable locations(two_layer_table());
  try {
    locations.id_of("model.layers.0.mlp.down_prj.input", "plan.json: intervention 3");
    FAIL() << "an unknown name was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("plan.json: intervention 3: unknown location 'model.layers.0.mlp.down_prj.input'"));
    EXPECT_THAT(e.what(), HasSubstr("did you mean model.layers.0.mlp.down_proj.input"));
  }
  try {
    locations.id_of("lm_head.output", "x");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::Not(HasSubstr("did you mean"))) << "nothing close: no guess";
  }
}

}  // namespace
}  // namespace frag::ir
