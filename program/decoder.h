//===- program/decoder.h - Generation from a KV cache -------------*- C++ -*-===//
//
// Drives one rank's model through cached generation: a prefill of new rows,
// then one token per row per decode step, every rank alike. The cache is this
// rank's: [layers, 2, max_batch, its kv heads, max_len, head size] (replicated
// kv heads stay replicated), allocated once, before anything runs.
//
// Layout: row b's token at position p lives in cache slot p. A prefill of
// prompts of different lengths pads them on the right to the longest; each
// token's position is its index, and a query attends to the slots at or
// before its own position, so no real token sees a pad, and a pad's slot is
// overwritten by the row's next token. Each row's tokens are those of its own
// unbatched run. Whole values at a prefill are [rows, longest prompt, width]
// (pad positions included), at a decode step [rows, 1, width].
//
//   Decoder decoder(model, /*max_batch=*/8, /*max_len=*/2048);
//   auto logits = decoder.prefill({{1, 2, 3}, {4, 5}});      // [2, vocab]
//   auto next = logits.argmax(-1);
//   logits = decoder.decode(next);                           // [2, vocab]
//   decoder.drop(0);                                         // row 1 becomes row 0
//   decoder.prefill({{6, 7, 8, 9}});                         // a new row 1
//
// A server keeps the step: each forward (a prefill or a decode step) is one
// generation step, numbered from 0; plan steps with "steps" act by it.
//
// Row ids: each row gets an id when its prefill adds it (0, 1, 2, ... in the
// order rows join, never reused), kept while other rows are dropped; a plan
// step's "rows" name these ids (in a plain forward, batch indices). A fixed
// batch's ids are its row indices.
//
// Batch buckets: a decode step of b rows runs as the smallest bucket >= b
// (padding rows: token 0 at position 0, in the cache's rows past the batch,
// which no real row reads), so on a GPU rows joining and leaving replay one
// CUDA graph per bucket instead of capturing one per batch size. The logits
// and saves are the real rows' only. Default buckets: on a GPU 1, 2, 4, 8, ...
// below max_batch, and max_batch; on a CPU none (each step its own size).
// set_batch_buckets picks others ({} : none).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "program/sharded_model.h"

#include <string>
#include <vector>

namespace frag::program {

class Decoder {
 public:
  /// Allocates this rank's cache for `max_batch` rows of `max_len` tokens on the model's device. One-line
  /// frag::Errors, before anything runs: a rank file whose forward takes no cache, `max_len` past the
  /// model's positions, a cache larger than the memory there.
  Decoder(ShardedModel& model, int64_t max_batch, int64_t max_len);

  int64_t max_batch() const { return max_batch_; }
  int64_t max_len() const { return max_len_; }
  /// Rows in the batch now; lengths()[r] is row r's tokens in the cache.
  int64_t rows() const { return static_cast<int64_t>(lengths_.size()); }
  const std::vector<int64_t>& lengths() const { return lengths_; }
  /// row_ids()[r] is row r's stable id (what a plan step's "rows" name).
  const std::vector<int64_t>& row_ids() const { return ids_; }
  int64_t cache_bytes() const { return cache_.numel() * cache_.element_size(); }
  /// "KV cache: 4 rows x 160 tokens, 30 layers, 1 kv head of 64 on this rank, float32: 9.4 MiB".
  std::string describe() const;
  /// The generation step the next forward is (0 for the first).
  int64_t step() const { return step_; }

  /// Adds one row per prompt after the current rows and runs their prefill (one forward, the prompts
  /// right-padded to the longest). Returns each new row's logits at its last prompt token [n, vocab].
  torch::Tensor prefill(const std::vector<std::vector<int64_t>>& prompts);
  /// One token per row ([rows] int64) at each row's next position; returns the logits [rows, vocab].
  torch::Tensor decode(const torch::Tensor& tokens);
  /// Removes a row; the rows after it move up by one, their cache with them.
  void drop(int64_t row);

  /// The batch sizes decode steps are padded to (ascending, each in [1, max_batch]; max_batch is added);
  /// {} for none. One-line frag::Error for a bucket outside [1, max_batch].
  void set_batch_buckets(std::vector<int64_t> buckets);
  const std::vector<int64_t>& batch_buckets() const { return buckets_; }
  /// The rows a decode step of `rows` rows runs as: the smallest bucket >= rows, else rows.
  int64_t bucket_for(int64_t rows) const;

  /// Greedy generation of `steps` tokens for each prompt: a prefill, then steps - 1 decode steps; saves
  /// are keyed "step{k}.". Returns each row's new tokens [rows, steps].
  torch::Tensor generate(const std::vector<std::vector<int64_t>>& prompts, int64_t steps);
  /// The same for a batch of equal-length prompts; returns [B, T + steps], the prompts included.
  torch::Tensor generate(const torch::Tensor& input_ids, int64_t steps);

 private:
  /// Runs one forward of the cached model on rows [first, first + ids.size(0)) at `positions`; `row_ids`:
  /// the rows' stable ids (padding rows past them).
  torch::Tensor run(const torch::Tensor& ids, const torch::Tensor& positions, int64_t first,
                    std::vector<int64_t> row_ids);

  ShardedModel& model_;
  int64_t max_batch_;
  int64_t max_len_;
  torch::Tensor cache_;
  std::vector<int64_t> buckets_;
  std::vector<int64_t> lengths_;
  std::vector<int64_t> ids_;
  int64_t next_id_ = 0;
  int64_t step_ = 0;
};

/// Greedy generation of `steps` tokens (ShardedModel::generate): from a Decoder sized for this batch where
/// the rank file's forward takes a KV cache (a prefill, then one token per step), else recomputing the
/// whole sequence each step (older files, .pt2 archives; forward k is generation step k there too, so a
/// plan step's "steps" act, over every position that forward computes). Saves are keyed "step{k}.".
/// Returns the tokens, input included.
torch::Tensor generate(ShardedModel& model, const torch::Tensor& input_ids, int64_t steps);

}  // namespace frag::program
