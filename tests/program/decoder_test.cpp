//===- tests/program/decoder_test.cpp - Generation from a KV cache ===//
//
// program::Decoder on the reference exports, ranks as threads over Gloo. The
// ground truth is the uncached forward of the same tokens (the whole sequence
// again each step) at tp=1: cached tokens must equal its greedy tokens, each
// row of a ragged batch its own unbatched run, and every tp alike.
//
//===----------------------------------------------------------------------===//
#include "ir/error.h"
#include "program/decoder.h"
#include "runtime/safetensors.h"
#include "tests/support/model_ranks.h"
#include "tests/support/test_support.h"

#include <gtest/gtest.h>

namespace frag::program {
namespace {

using testing::on_ranks;
using testing::temporary_folder;

const std::vector<std::vector<int64_t>> kPrompts = {{1, 2, 3, 4, 5}, {7, 8}, {9, 10, 11, 12, 13, 14, 15, 16}};
constexpr int64_t kSteps = 6;

/// `body` throws a frag::Error whose message contains `text`.
#define EXPECT_THROW_MESSAGE(body, text)                                              \
  do {                                                                                \
    try {                                                                             \
      body;                                                                           \
      ADD_FAILURE() << #body " did not throw";                                        \
    } catch (const Error& e) {                                                        \
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();     \
    }                                                                                 \
  } while (false)

void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

/// Greedy tokens of one prompt by the uncached forward: the whole sequence each step.
std::vector<int64_t> recomputed(ShardedModel& model, const std::vector<int64_t>& prompt, int64_t steps) {
  auto tokens = torch::tensor(prompt, torch::kLong).unsqueeze(0);
  std::vector<int64_t> out;
  for (int64_t s = 0; s < steps; ++s) {
    auto next = model.forward(tokens).select(1, tokens.size(1) - 1).argmax(-1);
    out.push_back(next.item<int64_t>());
    tokens = torch::cat({tokens, next.unsqueeze(0)}, 1);
  }
  return out;
}

/// Rank 0's rows of cached generation of kPrompts in one batch.
std::vector<std::vector<int64_t>> cached(const std::string& export_name) {
  std::vector<std::vector<int64_t>> rows;
  expect_no_errors(on_ranks(export_name, [&](int rank, ShardedModel& model) {
    Decoder decoder(model, 4, 32);
    auto tokens = decoder.generate(kPrompts, kSteps);
    if (rank == 0)
      for (int64_t b = 0; b < tokens.size(0); ++b)
        rows.emplace_back(tokens[b].data_ptr<int64_t>(), tokens[b].data_ptr<int64_t>() + tokens.size(1));
  }));
  return rows;
}

TEST(Decoder, RaggedBatchEqualsEachPromptsUncachedRunAtEveryTp) {
  FRAG_REQUIRE_GLOO();
  for (const std::string family : {"llama", "moe"}) {
    std::vector<std::vector<int64_t>> truth;
    expect_no_errors(on_ranks(family + "_tp1", [&](int, ShardedModel& model) {
      for (const auto& p : kPrompts) truth.push_back(recomputed(model, p, kSteps));
    }));
    for (const std::string tp : {"_tp1", "_tp2"}) {
      auto rows = cached(family + tp);
      ASSERT_EQ(rows.size(), kPrompts.size());
      for (size_t b = 0; b < rows.size(); ++b) EXPECT_EQ(rows[b], truth[b]) << family << tp << " row " << b;
    }
  }
}

TEST(Decoder, RowsJoinAndLeaveBetweenSteps) {
  FRAG_REQUIRE_GLOO();
  // A server's pattern: row 0 decodes, row 1 joins later, row 0 leaves; each row's tokens stay its own.
  std::vector<std::vector<int64_t>> truth;
  std::vector<int64_t> first, second;
  expect_no_errors(on_ranks("llama_tp2", [&](int rank, ShardedModel& model) {
    std::vector<std::vector<int64_t>> t;
    for (const auto& p : {kPrompts[0], kPrompts[2]}) t.push_back(recomputed(model, p, 5));
    Decoder decoder(model, 2, 32);
    std::vector<int64_t> a, b;
    auto next = decoder.prefill({kPrompts[0]}).argmax(-1);
    a.push_back(next.item<int64_t>());
    next = decoder.decode(next).argmax(-1);
    a.push_back(next.item<int64_t>());
    auto joined = decoder.prefill({kPrompts[2]}).argmax(-1);  // row 1
    b.push_back(joined.item<int64_t>());
    auto both = decoder.decode(torch::cat({next, joined})).argmax(-1);
    a.push_back(both[0].item<int64_t>());
    b.push_back(both[1].item<int64_t>());
    decoder.drop(0);  // row 1 becomes row 0, its cache with it
    EXPECT_EQ(decoder.rows(), 1);
    EXPECT_EQ(decoder.lengths(), (std::vector<int64_t>{9}));
    auto alone = decoder.decode(both.narrow(0, 1, 1)).argmax(-1);
    b.push_back(alone.item<int64_t>());
    if (rank == 0) truth = t, first = a, second = b;
  }));
  EXPECT_EQ(first, std::vector<int64_t>(truth[0].begin(), truth[0].begin() + 3));
  EXPECT_EQ(second, std::vector<int64_t>(truth[1].begin(), truth[1].begin() + 3));
}

TEST(Decoder, EditFromStepKChangesTokensFromKOnly) {
  FRAG_REQUIRE_GLOO();
  auto folder = temporary_folder();
  torch::manual_seed(3);
  runtime::write_safetensors(folder + "/v.safetensors", {{"v", torch::randn({64}) * 8}});
  auto run = [&](const std::string& steps) {
    std::vector<std::vector<int64_t>> rows;
    SavedTensors saved;
    expect_no_errors(on_ranks("llama_tp2", [&](int rank, ShardedModel& model) {
      nlohmann::json step = {{"at", "model.layers.1.output"}, {"do", "add"}, {"value", "v.safetensors:v"}};
      if (!steps.empty()) {
        step["steps"] = steps;
        model.apply(runtime::Plan::from_json(
            nlohmann::json::array({step, {{"at", "model.layers.0.output"}, {"do", "save"}, {"as", "h"}}}), "plan",
            folder));
      }
      Decoder decoder(model, 4, 32);
      auto tokens = decoder.generate(kPrompts, kSteps);
      if (rank == 0) {
        for (int64_t b = 0; b < tokens.size(0); ++b)
          rows.emplace_back(tokens[b].data_ptr<int64_t>(), tokens[b].data_ptr<int64_t>() + tokens.size(1));
        saved = model.saved();
      }
    }));
    return std::make_pair(rows, saved);
  };
  auto [plain, unused] = run("");
  auto [edited, saved] = run("3:");
  bool changed_at_3 = false;
  for (size_t b = 0; b < plain.size(); ++b) {
    for (int s = 0; s < 3; ++s) EXPECT_EQ(plain[b][s], edited[b][s]) << "row " << b << " step " << s;
    changed_at_3 |= plain[b][3] != edited[b][3];
  }
  EXPECT_TRUE(changed_at_3) << "an edit from step 3 on must change a token at step 3";
  // Saves per step: the prefill's whole is [rows, longest prompt, width], a decode step's [rows, 1, width].
  ASSERT_EQ(saved.count("step0.h"), 1u);
  EXPECT_EQ(saved.at("step0.h")[0].sizes(), (std::vector<int64_t>{3, 8, 64}));
  EXPECT_EQ(saved.at("step4.h")[0].sizes(), (std::vector<int64_t>{3, 1, 64}));
}

/// Rank 0's tokens and per-step logits [steps, rows, vocab] of greedy cached generation of kPrompts.
std::pair<std::vector<std::vector<int64_t>>, torch::Tensor> cached_with_logits(
    const std::string& export_name, const std::string& extension, const std::vector<int64_t>& buckets = {}) {
  std::vector<std::vector<int64_t>> rows(kPrompts.size());
  torch::Tensor logits;
  expect_no_errors(on_ranks(
      export_name,
      [&](int rank, ShardedModel& model) {
        Decoder decoder(model, 4, 32);
        decoder.set_batch_buckets(buckets);
        std::vector<torch::Tensor> steps{decoder.prefill(kPrompts)};
        for (int64_t s = 1; s < kSteps; ++s) steps.push_back(decoder.decode(steps.back().argmax(-1)));
        if (rank != 0) return;
        logits = torch::stack(steps);
        auto tokens = logits.argmax(-1);
        for (size_t b = 0; b < rows.size(); ++b)
          for (int64_t s = 0; s < kSteps; ++s) rows[b].push_back(tokens[s][b].item<int64_t>());
      },
      std::chrono::seconds(60), extension));
  return {rows, logits};
}

double relative(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max() / b.to(torch::kDouble).abs().max()).item<double>();
}

TEST(Decoder, CachedPt2ArchiveGeneratesAsTorchScript) {
  FRAG_REQUIRE_GLOO();
  FRAG_REQUIRE_NATIVERT();
  // The same weights exported with the cached forward as .pt2 (NativeRT runs prefill and decode steps of the
  // one archive): the same tokens as the TorchScript file, logits within 1e-5 (fp32), at tp 1 and 2.
  for (const std::string family : {"llama", "moe"}) {
    for (const std::string tp : {"_tp1", "_tp2"}) {
      auto [script_rows, script_logits] = cached_with_logits(family + tp, "pt");
      auto [rows, logits] = cached_with_logits(family + tp + "_pt2_kv", "pt2");
      EXPECT_EQ(rows, script_rows) << family << tp;
      ASSERT_TRUE(logits.defined() && script_logits.defined());
      EXPECT_LE(relative(logits, script_logits), 1e-5) << family << tp;
    }
  }
}

TEST(Decoder, CachedPt2ArchiveRunsPlainForwardsToo) {
  FRAG_REQUIRE_GLOO();
  FRAG_REQUIRE_NATIVERT();
  // Without a cache (frag run, a trace), the cached archive runs positions 0..T-1 into a scratch cache.
  auto ids = torch::tensor(kPrompts[2], torch::kLong).unsqueeze(0).repeat({2, 1});
  torch::Tensor script, exported;
  expect_no_errors(on_ranks("llama_tp2", [&](int rank, ShardedModel& model) {
    auto out = model.forward(ids);
    if (rank == 0) script = out;
  }));
  expect_no_errors(on_ranks(
      "llama_tp2_pt2_kv",
      [&](int rank, ShardedModel& model) {
        EXPECT_TRUE(model.program().has_kv_cache());
        auto out = model.forward(ids);
        if (rank == 0) exported = out;
      },
      std::chrono::seconds(30), "pt2"));
  ASSERT_TRUE(script.defined() && exported.defined());
  EXPECT_LE(relative(exported, script), 1e-5);
}

TEST(Decoder, Pt2ArchiveWithoutCacheStillGeneratesByRecomputing) {
  FRAG_REQUIRE_GLOO();
  FRAG_REQUIRE_NATIVERT();
  auto ids = torch::tensor(kPrompts[0], torch::kLong).unsqueeze(0);
  torch::Tensor script, exported;
  expect_no_errors(on_ranks("llama_tp2", [&](int rank, ShardedModel& model) {
    auto out = model.generate(ids, 3);
    if (rank == 0) script = out;
  }));
  expect_no_errors(on_ranks(
      "llama_tp2_pt2",
      [&](int rank, ShardedModel& model) {
        EXPECT_FALSE(model.program().has_kv_cache());
        auto out = model.generate(ids, 3);
        if (rank == 0) exported = out;
      },
      std::chrono::seconds(30), "pt2"));
  ASSERT_TRUE(script.defined() && exported.defined());
  EXPECT_TRUE(torch::equal(exported, script));
}

TEST(Decoder, BatchBucketsPadDecodeStepsWithoutChangingRealRows) {
  FRAG_REQUIRE_GLOO();
  // The bucketing a GPU's decode graphs use, run eagerly: 3 rows padded to a bucket of 4 give the tokens of 3
  // rows unpadded, logits within 1e-5, and the saves hold the 3 real rows.
  auto [plain, plain_logits] = cached_with_logits("llama_tp2", "pt");
  auto [padded, padded_logits] = cached_with_logits("llama_tp2", "pt", {4});
  EXPECT_EQ(padded, plain);
  EXPECT_LE(relative(padded_logits, plain_logits), 1e-5);
  SavedTensors saved;
  expect_no_errors(on_ranks("llama_tp1", [&](int, ShardedModel& model) {
    model.apply(runtime::Plan::from_json(
        nlohmann::json::array({{{"at", "model.layers.0.output"}, {"do", "save"}, {"as", "h"}}}), "plan", ""));
    Decoder decoder(model, 4, 32);
    EXPECT_TRUE(decoder.batch_buckets().empty()) << "a CPU pads nothing by default";
    decoder.set_batch_buckets({2});
    EXPECT_EQ(decoder.batch_buckets(), (std::vector<int64_t>{2, 4})) << "max_batch is always a bucket";
    EXPECT_EQ(decoder.bucket_for(1), 2);
    EXPECT_EQ(decoder.bucket_for(3), 4);
    EXPECT_THROW_MESSAGE(decoder.set_batch_buckets({8}), "a batch bucket of 8 rows is outside 1..4");
    decoder.generate(kPrompts, 3);
    saved = model.saved();
  }));
  ASSERT_EQ(saved.count("step2.h"), 1u);
  EXPECT_EQ(saved.at("step2.h")[0].sizes(), (std::vector<int64_t>{3, 1, 64}));
  // Rows joining and leaving: the batch goes 1 -> 2 -> 1 rows, each step padded to a bucket of 2.
  std::vector<std::vector<int64_t>> truth;
  std::vector<int64_t> first, second;
  expect_no_errors(on_ranks("llama_tp1", [&](int, ShardedModel& model) {
    for (const auto& p : {kPrompts[0], kPrompts[2]}) truth.push_back(recomputed(model, p, 4));
    Decoder decoder(model, 2, 32);
    decoder.set_batch_buckets({2});
    auto next = decoder.prefill({kPrompts[0]}).argmax(-1);
    first.push_back(next.item<int64_t>());
    next = decoder.decode(next).argmax(-1);  // 1 row padded to 2
    first.push_back(next.item<int64_t>());
    auto joined = decoder.prefill({kPrompts[2]}).argmax(-1);
    second.push_back(joined.item<int64_t>());
    auto both = decoder.decode(torch::cat({next, joined})).argmax(-1);
    first.push_back(both[0].item<int64_t>());
    second.push_back(both[1].item<int64_t>());
    decoder.drop(0);
    second.push_back(decoder.decode(both.narrow(0, 1, 1)).argmax(-1).item<int64_t>());  // padded again
  }));
  EXPECT_EQ(first, std::vector<int64_t>(truth[0].begin(), truth[0].begin() + 3));
  EXPECT_EQ(second, std::vector<int64_t>(truth[1].begin(), truth[1].begin() + 3));
}

TEST(Decoder, PerRowEditValuesBindToTheRealRowsOfAPaddedBucket) {
  FRAG_REQUIRE_GLOO();
  // An edit whose value is shaped per row ([3, 1, 64]: each row its own vector, at every step) while decode
  // steps of 3 rows run padded to a bucket of 4: the value binds to the 3 real rows (the padding row is not
  // a row of the plan), and each row's tokens are those of its prompt generated alone with its own vector.
  auto folder = temporary_folder();
  torch::manual_seed(11);
  auto values = torch::randn({3, 1, 64}) * 8;
  runtime::write_safetensors(folder + "/v.safetensors", {{"v", values}});
  for (int64_t b = 0; b < 3; ++b)
    runtime::write_safetensors(folder + "/v" + std::to_string(b) + ".safetensors", {{"v", values[b].clone()}});
  auto plan = [&](const std::string& file) {
    return runtime::Plan::from_json(
        nlohmann::json::array({{{"at", "model.layers.1.output"}, {"do", "add"}, {"value", file + ":v"}},
                               {{"at", "model.layers.0.output"}, {"do", "save"}, {"as", "h"}}}),
        "plan", folder);
  };
  std::vector<std::vector<int64_t>> alone, plain, padded;
  SavedTensors saved;
  std::vector<int64_t> callback_rows;
  expect_no_errors(on_ranks("llama_tp1", [&](int, ShardedModel& model) {
    for (size_t b = 0; b < kPrompts.size(); ++b) {  // the truth: each prompt alone with its own vector
      model.clear();
      model.apply(plan("v" + std::to_string(b) + ".safetensors"));
      Decoder decoder(model, 1, 32);
      auto t = decoder.generate({kPrompts[b]}, kSteps);
      alone.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + kSteps);
    }
    model.clear();
    Decoder unedited(model, 4, 32);
    auto t = unedited.generate(kPrompts, kSteps);
    for (int64_t b = 0; b < t.size(0); ++b) plain.emplace_back(t[b].data_ptr<int64_t>(), t[b].data_ptr<int64_t>() + kSteps);
    model.apply(plan("v.safetensors"));
    // A callback sees the real rows too.
    model.on(
        "model.layers.0.output",
        [&](torch::Tensor& whole, const runtime::VisitInfo&) -> std::optional<torch::Tensor> {
          callback_rows.push_back(whole.size(0));
          return std::nullopt;
        },
        std::nullopt, "rows", /*edits=*/false);
    model.clear_saved();
    Decoder decoder(model, 4, 32);
    decoder.set_batch_buckets({4});
    t = decoder.generate(kPrompts, kSteps);
    for (int64_t b = 0; b < t.size(0); ++b)
      padded.emplace_back(t[b].data_ptr<int64_t>(), t[b].data_ptr<int64_t>() + kSteps);
    saved = model.saved();
  }));
  EXPECT_NE(alone, plain) << "the per-row values must change the tokens (else this proves nothing)";
  EXPECT_EQ(padded, alone) << "each real row of the padded bucket gets its own value";
  EXPECT_EQ(callback_rows, std::vector<int64_t>(kSteps, 3)) << "the prefill's 3 rows, then 3 real rows of 4";
  ASSERT_EQ(saved.count("step1.h"), 1u);
  EXPECT_EQ(saved.at("step1.h")[0].sizes(), (std::vector<int64_t>{3, 1, 64}));
}

TEST(Decoder, PlanRowsNameStableRowIdsThatSurviveDrops) {
  FRAG_REQUIRE_GLOO();
  auto folder = temporary_folder();
  torch::manual_seed(5);
  runtime::write_safetensors(folder + "/v.safetensors", {{"v", torch::randn({64}) * 8}});
  auto plan = [&](bool rows) {
    nlohmann::json step = {{"at", "model.layers.1.output"}, {"do", "add"}, {"value", "v.safetensors:v"}};
    if (rows) step["rows"] = {1};
    return runtime::Plan::from_json(nlohmann::json::array({step}), "plan", folder);
  };
  std::vector<int64_t> edited_alone, plain_alone, plain_joined, id1, id2;
  expect_no_errors(on_ranks("llama_tp1", [&](int, ShardedModel& model) {
    plain_joined = recomputed(model, kPrompts[1], 2);
    plain_alone = recomputed(model, kPrompts[2], 4);
    model.apply(plan(false));  // the edit on every row: kPrompts[2] alone, edited
    Decoder alone(model, 1, 32);
    auto t = alone.generate({kPrompts[2]}, 4);
    edited_alone.assign(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + 4);
    model.clear();
    model.apply(plan(true));  // the edit on the row of id 1 only
    Decoder decoder(model, 2, 32);
    auto next = decoder.prefill({kPrompts[0], kPrompts[2]}).argmax(-1);  // ids 0 and 1
    id1.push_back(next[1].item<int64_t>());
    next = decoder.decode(next).argmax(-1);
    id1.push_back(next[1].item<int64_t>());
    decoder.drop(0);  // id 1 is now row 0
    EXPECT_EQ(decoder.row_ids(), (std::vector<int64_t>{1}));
    next = decoder.decode(next.narrow(0, 1, 1)).argmax(-1);
    id1.push_back(next.item<int64_t>());
    auto joined = decoder.prefill({kPrompts[1]}).argmax(-1);  // id 2, row 1: not edited
    EXPECT_EQ(decoder.row_ids(), (std::vector<int64_t>{1, 2}));
    id2.push_back(joined.item<int64_t>());
    auto both = decoder.decode(torch::cat({next, joined})).argmax(-1);
    id1.push_back(both[0].item<int64_t>());
    id2.push_back(both[1].item<int64_t>());
  }));
  EXPECT_NE(edited_alone, plain_alone) << "the edit must change the tokens (else this proves nothing)";
  EXPECT_EQ(id1, edited_alone) << "the row of id 1 keeps its edit after row 0 is dropped";
  EXPECT_EQ(id2, plain_joined) << "a row that joins later at index 1 is not the row of id 1";
}

TEST(Decoder, RefusesWhatDoesNotFitBeforeRunning) {
  FRAG_REQUIRE_GLOO();
  auto errors = on_ranks("llama_tp1", [&](int, ShardedModel& model) {
    Decoder decoder(model, 2, 8);
    EXPECT_NE(decoder.describe().find("2 rows x 8 tokens"), std::string::npos) << decoder.describe();
    EXPECT_THROW_MESSAGE(decoder.prefill({{1, 2, 3, 4, 5, 6, 7, 8, 9}}), "a prompt of 9 tokens is past");
    EXPECT_THROW_MESSAGE(decoder.prefill({{1}, {2}, {3}}), "a batch of 3 rows is past the KV cache's bound of 2");
    EXPECT_THROW_MESSAGE(decoder.generate({{1, 2, 3, 4, 5, 6}}, 4), "do not fit the KV cache's 8 tokens");
    EXPECT_THROW_MESSAGE(Decoder(model, 1, 100000), "past the model's 512 positions");
    EXPECT_THROW_MESSAGE(Decoder(model, int64_t{1} << 40, 512), "more than the");
    EXPECT_EQ(decoder.step(), 0) << "nothing ran";
  });
  expect_no_errors(errors);
}

}  // namespace
}  // namespace frag::program
