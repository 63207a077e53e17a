//===- cli/token_ids.h - Read and check token ids --------------*- C++ -*-===//
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace frag::cli {

/// Reads ids.txt: one sequence per line, ids separated by spaces, every line
/// the same length. Returns int64 [B, T]. Bad input: frag::Error with file and line.
torch::Tensor read_token_ids(const std::string& path);

/// "9 tokens" for one sequence, "2 sequences of 9 tokens" for more.
std::string describe_shape(int64_t sequences, int64_t tokens);

/// The shape and a digest of int64 [B, T] ids and where they came from,
/// "B T digest source": what ranks compare to be sure that they run the same input.
std::string ids_fingerprint(const torch::Tensor& ids, const std::string& source);

/// Compares every rank's fingerprint (rank order) and returns the error to
/// report ("" when all agree): "rank 1 has 7 tokens (…), rank 0 has 9 (…)",
/// or, for the same shape, which rank's ids differ.
std::string compare_fingerprints(const std::vector<std::string>& fingerprints);

/// "" if every id of int64 [B, T] `ids` lies in [0, vocab), else an error
/// naming the first id outside, its sequence and position (1-based) and the
/// vocabulary size. `source` names the ids ("--input ids.txt"), `embedding`
/// the layer the vocabulary comes from.
std::string check_ids_in_vocab(const torch::Tensor& ids, int64_t vocab, const std::string& source,
                               const std::string& embedding);

}  // namespace frag::cli
