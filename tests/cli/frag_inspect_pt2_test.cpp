//===- tests/cli/frag_inspect_pt2_test.cpp - `frag inspect` on .pt2 archives ===//
//
// The reference models exported twice from the same weights, as TorchScript
// (rank{r}.pt) and with torch.export (rank{r}.pt2, tests/models/BUILD's *_pt2):
// `frag inspect --json` must list the same fragmented locations, in the same
// order, with the same layouts, rules, whole widths and groups, the same whole
// and rank-local locations (whole_at included), and the same layers with the
// same notes, for all rank files of each (llama and qwen2-moe at tp 2 and 4, kv
// heads replicated in llama_kv2_tp4). `frag rewrite` of the archives embeds
// that table and inserts one triple per fragmented location and one lone
// intervene per whole one. Damaged archives (another schema major, no recorded
// config, a layer missing from the record, no preserved call signatures, not a
// zip), rewritten archives given again and mixed formats end with one
// "frag: error:" line naming the file, and leave no output behind.
//
//===----------------------------------------------------------------------===//
#include "tests/support/inspect_json.h"
#include "tests/support/test_support.h"

#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>

namespace frag {
namespace {

using testing::frag;
using testing::inspect_json;
using testing::lines_of;
using testing::model_files;
using testing::temporary_folder;

std::vector<std::string> pt2_files(const std::string& export_name) { return model_files(export_name, "pt2"); }

/// The one error line of a refused run; empty (with a failure) otherwise.
std::string refusal(const std::vector<std::string>& args) {
  auto result = frag(args);
  EXPECT_NE(result.exit_code, 0) << result.out;
  EXPECT_EQ(result.out, "");
  auto lines = lines_of(result.err);
  EXPECT_EQ(lines.size(), 1u) << result.err;
  if (lines.empty()) return "";
  EXPECT_EQ(lines[0].rfind("frag: error: ", 0), 0u) << lines[0];
  return lines[0];
}

struct Case {
  const char* pt2;
  const char* torchscript;
};

class InspectPt2 : public ::testing::TestWithParam<Case> {};

TEST_P(InspectPt2, SameLocationsAndLayoutsAsTheTorchScriptExport) {
  const auto ts_files = model_files(GetParam().torchscript);
  const auto files = pt2_files(GetParam().pt2);
  ASSERT_EQ(files.size(), ts_files.size());
  const auto expected = inspect_json({ts_files[0]});
  const auto report = inspect_json(files);  // every rank: the tables must agree
  ASSERT_FALSE(expected["fragmented"].empty());
  EXPECT_EQ(report["tp_size"], expected["tp_size"]);
  EXPECT_EQ(report["tp_size"].get<int64_t>(), static_cast<int64_t>(files.size()));
  ASSERT_EQ(report["fragmented"].size(), expected["fragmented"].size()) << report["fragmented"].dump(1);
  for (size_t i = 0; i < expected["fragmented"].size(); ++i)
    EXPECT_EQ(report["fragmented"][i], expected["fragmented"][i]) << "row " << i;
  EXPECT_EQ(report["layers"], expected["layers"]);
  // Heads come from the configs the kit records beside the graph: the same regions.
  EXPECT_FALSE(expected["heads"].empty());
  EXPECT_EQ(report["heads"], expected["heads"]);
  // The graph analysis of the .pt2 rewrite finds the same whole and rank-local values, in the same order.
  ASSERT_FALSE(expected["whole"].empty());
  ASSERT_FALSE(expected["rank_local"].empty());
  EXPECT_EQ(report["whole"], expected["whole"]);
  EXPECT_EQ(report["rank_local"], expected["rank_local"]);
}

/// The rewritten archives of one export in a fresh folder (frag rewrite must succeed).
std::vector<std::string> rewritten(const std::vector<std::string>& files, const std::string& folder) {
  std::vector<std::string> args = {"rewrite"};
  args.insert(args.end(), files.begin(), files.end());
  args.insert(args.end(), {"-o", folder});
  auto result = frag(args);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  std::vector<std::string> out;
  for (const auto& file : files) out.push_back(folder + "/" + std::filesystem::path(file).filename().string());
  return out;
}

std::string record_of(const std::string& archive, const std::string& name) {
  caffe2::serialize::PyTorchStreamReader reader(archive);
  auto [data, size] = reader.getRecord(name);
  return std::string(static_cast<const char*>(data.get()), size);
}

TEST_P(InspectPt2, RewriteEmbedsTheTableAndInsertsOneTriplePerFragmentedLocation) {
  const auto files = pt2_files(GetParam().pt2);
  const auto folder = temporary_folder();
  const auto outputs = rewritten(files, folder);
  const auto report = inspect_json({files[0]});
  for (const auto& output : outputs) {
    auto table = nlohmann::json::parse(record_of(output, "extra/fragments/rules.json"));
    EXPECT_EQ(table["whole"], report["whole"]) << output;
    EXPECT_EQ(table["layers"].size(), report["layers"].size()) << output;
    auto model = nlohmann::json::parse(record_of(output, "models/model.json"));
    std::map<std::string, std::multiset<std::string>> locations_of;  // target -> the locations of its nodes
    for (const auto& node : model["graph_module"]["graph"]["nodes"]) {
      const std::string target = node["target"];
      if (target.rfind("torch.ops.frag.", 0) != 0 || target.find("all_") != std::string::npos) continue;
      for (const auto& input : node["inputs"])
        if (input["name"] == "location") locations_of[target].insert(input["arg"]["as_string"].get<std::string>());
    }
    std::multiset<std::string> fragmented, whole;
    for (const auto& row : report["fragmented"]) fragmented.insert(row["location"].get<std::string>());
    for (const auto& location : report["whole"]) whole.insert(location.get<std::string>());
    EXPECT_EQ(locations_of["torch.ops.frag.gather.default"], fragmented) << output;
    EXPECT_EQ(locations_of["torch.ops.frag.split.default"], fragmented) << output;
    std::multiset<std::string> intervened = fragmented;
    intervened.insert(whole.begin(), whole.end());
    EXPECT_EQ(locations_of["torch.ops.frag.intervene.default"], intervened) << output;
    // Everything else is the original archive's, byte for byte.
    EXPECT_EQ(record_of(output, "data/weights/model_weights_config.json"),
              record_of(files[0], "data/weights/model_weights_config.json"));
    EXPECT_EQ(record_of(output, "extra/fragkit.json"), record_of(files[&output - &outputs[0]], "extra/fragkit.json"));
  }
  // A rewritten archive is not an original export: refused by inspect and by rewrite, once.
  auto line = refusal({"inspect", outputs[0]});
  EXPECT_NE(line.find("already rewritten"), std::string::npos) << line;
  line = refusal({"rewrite", outputs[0], "-o", folder + "/again.pt2"});
  EXPECT_NE(line.find("already rewritten"), std::string::npos) << line;
  EXPECT_FALSE(std::filesystem::exists(folder + "/again.pt2"));
  testing::remove_flat_folder(folder);
}

TEST(InspectPt2Text, TextReportListsTheSameRows) {
  // One case (kv heads replicated): the JSON cases above cover every model; this covers the text printer.
  const auto files = pt2_files("llama_kv2_tp4_pt2");
  auto pt2 = frag({"inspect", files[0]});
  auto ts = frag({"inspect", model_files("llama_kv2_tp4")[0]});
  ASSERT_EQ(pt2.exit_code, 0) << pt2.err;
  ASSERT_EQ(ts.exit_code, 0) << ts.err;
  // The table of fragmented locations: from its heading to the blank line after it.
  auto rows = [](const std::string& text) {
    auto lines = lines_of(text);
    std::vector<std::string> out;
    bool in = false;
    for (const auto& line : lines) {
      if (line.rfind("fragmented locations", 0) == 0) in = true;
      else if (in && line.empty()) break;
      if (in) out.push_back(line);
    }
    return out;
  };
  EXPECT_GT(rows(ts.out).size(), 2u);
  EXPECT_EQ(rows(pt2.out), rows(ts.out));
  EXPECT_EQ(pt2.out.find("not analysed"), std::string::npos) << pt2.out;
  // The rank-local section lists the same values.
  auto section = [](const std::string& text) { return text.substr(text.find("rank-local values")); };
  EXPECT_EQ(section(pt2.out), section(ts.out));
}

INSTANTIATE_TEST_SUITE_P(ReferenceModels, InspectPt2,
                         ::testing::Values(Case{"llama_tp2_pt2", "llama_tp2"}, Case{"llama_tp4_pt2", "llama_tp4"},
                                           Case{"llama_kv2_tp4_pt2", "llama_kv2_tp4"},
                                           Case{"moe_tp2_pt2", "moe_tp2"}, Case{"moe_tp4_pt2", "moe_tp4"}),
                         [](const auto& info) { return std::string(info.param.pt2); });

// ---------------------------------------------------------------------------
// Damaged archives

/// Copies the archive `from` to `to`, each record through `edit(name, bytes)`; a record it empties is left out.
/// The writer adds its own version, byte order and id records.
void copy_archive(const std::string& from, const std::string& to,
                  const std::function<std::string(const std::string&, std::string)>& edit) {
  caffe2::serialize::PyTorchStreamReader reader(from);
  caffe2::serialize::PyTorchStreamWriter writer(to);
  const std::set<std::string> written_by_writer = {".data/version", "version", "byteorder", ".data/serialization_id"};
  for (const auto& name : reader.getAllRecords()) {
    if (written_by_writer.count(name)) continue;
    auto [data, size] = reader.getRecord(name);
    std::string bytes = edit(name, std::string(static_cast<const char*>(data.get()), size));
    if (!bytes.empty()) writer.writeRecord(name, bytes.data(), bytes.size());
  }
  writer.writeEndOfFile();
}

std::string edited_json(const std::string& bytes, const std::function<void(nlohmann::json&)>& edit) {
  auto json = nlohmann::json::parse(bytes);
  edit(json);
  return json.dump();
}

class DamagedPt2 : public ::testing::Test {
 protected:
  void SetUp() override {
    folder_ = temporary_folder();
    original_ = pt2_files("llama_tp2_pt2")[0];
  }
  void TearDown() override { testing::remove_flat_folder(folder_); }

  std::string damaged(const std::string& name,
                      const std::function<std::string(const std::string&, std::string)>& edit) {
    auto path = folder_ + "/" + name + ".pt2";
    copy_archive(original_, path, edit);
    return path;
  }

  std::string folder_, original_;
};

TEST_F(DamagedPt2, AnUntouchedCopyIsInspectedAsTheOriginal) {
  // The copying itself changes nothing that matters: the refusals below come from the edits.
  auto copy = damaged("copy", [](const std::string&, std::string bytes) { return bytes; });
  auto a = inspect_json({copy});
  auto b = inspect_json({original_});
  EXPECT_FALSE(a["fragmented"].empty());
  EXPECT_EQ(a["fragmented"], b["fragmented"]);
}

TEST_F(DamagedPt2, AnotherSchemaMajorIsRefused) {
  auto path = damaged("schema9", [](const std::string& name, std::string bytes) {
    if (name != "models/model.json") return bytes;
    return edited_json(bytes, [](nlohmann::json& j) { j["schema_version"]["major"] = 9; });
  });
  auto line = refusal({"inspect", path});
  EXPECT_NE(line.find(path), std::string::npos) << line;
  EXPECT_NE(line.find("schema version 9."), std::string::npos) << line;
  EXPECT_NE(line.find("schema major 8"), std::string::npos) << line;
}

TEST_F(DamagedPt2, AnArchiveWithoutTheKitsRecordIsRefused) {
  auto path = damaged("no_record", [](const std::string& name, std::string bytes) {
    return name == "extra/fragkit.json" ? std::string() : bytes;
  });
  auto line = refusal({"inspect", path});
  EXPECT_NE(line.find(path), std::string::npos) << line;
  EXPECT_NE(line.find("extra/fragkit.json"), std::string::npos) << line;
  EXPECT_NE(line.find("found none"), std::string::npos) << line;
}

TEST_F(DamagedPt2, ARecordWithoutLayerConfigsIsRefused) {
  auto path = damaged("no_layers", [](const std::string& name, std::string bytes) {
    if (name != "extra/fragkit.json") return bytes;
    return edited_json(bytes, [](nlohmann::json& j) {
      j.erase("layers");
      j.erase("layers_format");
    });
  });
  auto line = refusal({"inspect", path});
  EXPECT_NE(line.find(path), std::string::npos) << line;
  EXPECT_NE(line.find("no layer configs"), std::string::npos) << line;
}

TEST_F(DamagedPt2, ALayerMissingFromTheRecordIsRefusedByName) {
  const std::string layer = "model.layers.1.mlp.down_proj";
  auto path = damaged("one_missing", [&](const std::string& name, std::string bytes) {
    if (name != "extra/fragkit.json") return bytes;
    return edited_json(bytes, [&](nlohmann::json& j) {
      auto& layers = j["layers"];
      for (auto it = layers.begin(); it != layers.end(); ++it)
        if ((*it)["path"] == layer) {
          layers.erase(it);
          break;
        }
    });
  });
  auto line = refusal({"inspect", path});
  EXPECT_NE(line.find(path), std::string::npos) << line;
  EXPECT_NE(line.find(layer + " (RowParallelLinear)"), std::string::npos) << line;
  EXPECT_NE(line.find("no recorded layer config"), std::string::npos) << line;
}

TEST_F(DamagedPt2, AConfigOfTheWrongTypeIsRefusedAsForTorchScript) {
  auto path = damaged("bad_type", [](const std::string& name, std::string bytes) {
    if (name != "extra/fragkit.json") return bytes;
    return edited_json(bytes, [](nlohmann::json& j) {
      for (auto& layer : j["layers"])
        if (layer["path"] == "model.layers.0.mlp.gate_up_proj") layer["config"]["output_sizes"] = "128,128";
    });
  });
  auto line = refusal({"inspect", path});
  EXPECT_NE(line.find("model.layers.0.mlp.gate_up_proj"), std::string::npos) << line;
  EXPECT_NE(line.find("'output_sizes' should be List[int]"), std::string::npos) << line;
}

TEST(InspectPt2Inputs, MixedFormatsAreRefused) {
  auto line = refusal({"inspect", pt2_files("llama_tp2_pt2")[0], model_files("llama_tp2")[1]});
  EXPECT_NE(line.find("torch.export archive"), std::string::npos) << line;
  EXPECT_NE(line.find("TorchScript"), std::string::npos) << line;
}

TEST(InspectPt2Inputs, RankFilesOfDifferentExportsDisagree) {
  // Rank 0 of tp 2 with rank 1 of tp 4: the tables differ (tp_size), named by file.
  auto a = pt2_files("llama_tp2_pt2")[0];
  auto b = pt2_files("llama_tp4_pt2")[1];
  auto line = refusal({"inspect", a, b});
  EXPECT_NE(line.find(a), std::string::npos) << line;
  EXPECT_NE(line.find(b), std::string::npos) << line;
}

TEST(InspectPt2Inputs, RewriteOfMixedFormatsIsRefused) {
  auto folder = temporary_folder();
  auto line = refusal({"rewrite", pt2_files("llama_tp2_pt2")[0], model_files("llama_tp2")[1], "-o", folder});
  EXPECT_NE(line.find("torch.export archive"), std::string::npos) << line;
  EXPECT_TRUE(std::filesystem::is_empty(folder));
  testing::remove_flat_folder(folder);
}

TEST_F(DamagedPt2, AnArchiveWithoutCallSignaturesIsRefusedByRewriteAndInspect) {
  // torch.export without preserve_module_call_signature: the graph no longer says where modules begin and end.
  auto path = damaged("no_signatures", [](const std::string& name, std::string bytes) {
    if (name != "models/model.json") return bytes;
    return edited_json(bytes, [](nlohmann::json& j) {
      for (auto& call : j["graph_module"]["module_call_graph"])
        if (call["fqn"] != "") call["signature"] = nullptr;
    });
  });
  for (const char* command : {"inspect", "rewrite"}) {
    std::vector<std::string> args = {command, path};
    if (std::string(command) == "rewrite") args.insert(args.end(), {"-o", folder_ + "/out.pt2"});
    auto line = refusal(args);
    EXPECT_NE(line.find(path), std::string::npos) << line;
    EXPECT_NE(line.find("call signature"), std::string::npos) << line;
    EXPECT_NE(line.find("found none"), std::string::npos) << line;
  }
  EXPECT_FALSE(std::filesystem::exists(folder_ + "/out.pt2"));
}

TEST_F(DamagedPt2, ANestedGraphIsRefusedByName) {
  auto path = damaged("nested", [](const std::string& name, std::string bytes) {
    if (name != "models/model.json") return bytes;
    return edited_json(bytes, [](nlohmann::json& j) {
      auto& node = j["graph_module"]["graph"]["nodes"][3];
      node["inputs"].push_back({{"name", "true_fn"}, {"arg", {{"as_graph", {{"name", "true_graph_0"}}}}}, {"kind", 1}});
    });
  });
  auto line = refusal({"rewrite", path, "-o", folder_ + "/out.pt2"});
  EXPECT_NE(line.find(path), std::string::npos) << line;
  EXPECT_NE(line.find("nested graph"), std::string::npos) << line;
  EXPECT_FALSE(std::filesystem::exists(folder_ + "/out.pt2"));
}

}  // namespace
}  // namespace frag
