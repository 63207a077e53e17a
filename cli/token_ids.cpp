//===- cli/token_ids.cpp - Read token ids from text --------------------===//
#include "cli/token_ids.h"

#include "ir/digest.h"
#include "ir/error.h"
#include "cli/safe_files.h"

#include <fmt/format.h>

#include <fstream>
#include <sstream>
#include <tuple>
#include <vector>

namespace frag::cli {

torch::Tensor read_token_ids(const std::string& path) {
  require_regular_file(path, "the token id file");
  std::ifstream in(path);
  if (!in) fail("{}: cannot open the token id file", path);
  std::vector<std::vector<int64_t>> rows;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::istringstream words(line);
    std::vector<int64_t> row;
    std::string word;
    while (words >> word) {
      size_t used = 0;
      long long id = -1;
      try {
        id = std::stoll(word, &used);
      } catch (const std::exception&) {
      }
      if (used != word.size() || id < 0)
        fail("{}:{}: '{}' is not a token id (a non-negative integer)", path, number, word);
      row.push_back(id);
    }
    if (!rows.empty() && row.size() != rows.front().size())
      fail("{}:{}: {} ids, but the first sequence has {}; all sequences must be the same length",
           path, number, row.size(), rows.front().size());
    rows.push_back(std::move(row));
  }
  if (rows.empty()) fail("{}: no token ids", path);
  auto ids = torch::empty({static_cast<int64_t>(rows.size()), static_cast<int64_t>(rows[0].size())},
                          torch::kLong);
  auto view = ids.accessor<int64_t, 2>();
  for (size_t b = 0; b < rows.size(); ++b)
    for (size_t t = 0; t < rows[b].size(); ++t) view[b][t] = rows[b][t];
  return ids;
}

std::string describe_shape(int64_t sequences, int64_t tokens) {
  return sequences == 1 ? fmt::format("{} tokens", tokens) : fmt::format("{} sequences of {} tokens", sequences, tokens);
}

std::string ids_fingerprint(const torch::Tensor& ids, const std::string& source) {
  auto cpu = ids.to(torch::kCPU, torch::kLong).contiguous();
  // Each id in little-endian order: equal digests for equal ids on every rank and platform.
  uint64_t digest = ir::kFnvOffsetBasis;
  const auto* data = cpu.data_ptr<int64_t>();
  for (int64_t i = 0; i < cpu.numel(); ++i) digest = ir::fnv1a_le(static_cast<uint64_t>(data[i]), digest);
  return fmt::format("{} {} {:016x} {}", cpu.size(0), cpu.size(1), digest, source);
}

std::string compare_fingerprints(const std::vector<std::string>& fingerprints) {
  struct Input {
    int64_t sequences = 0, tokens = 0;
    std::string digest, source;
  };
  auto parse = [](const std::string& text) {
    std::istringstream in(text);
    Input input;
    in >> input.sequences >> input.tokens >> input.digest;
    std::getline(in >> std::ws, input.source);
    return input;
  };
  const Input first = parse(fingerprints.at(0));
  for (size_t r = 1; r < fingerprints.size(); ++r) {
    const Input other = parse(fingerprints[r]);
    if (other.sequences != first.sequences || other.tokens != first.tokens) {
      const bool same_batch = other.sequences == first.sequences;
      return fmt::format("the ranks were given token ids of different shapes: rank {} has {} ({}), rank 0 has {} ({})",
                         r, same_batch ? fmt::format("{} tokens", other.tokens) : describe_shape(other.sequences, other.tokens),
                         other.source, same_batch ? fmt::format("{}", first.tokens) : describe_shape(first.sequences, first.tokens),
                         first.source);
    }
    if (other.digest != first.digest)
      return fmt::format("the ranks were given different token ids of the same shape ({}): rank {}'s ({}, digest {}) "
                         "differ from rank 0's ({}, digest {}); every rank must run the same input",
                         describe_shape(first.sequences, first.tokens), r, other.source, other.digest, first.source,
                         first.digest);
  }
  return "";
}

std::string check_ids_in_vocab(const torch::Tensor& ids, int64_t vocab, const std::string& source,
                               const std::string& embedding) {
  auto cpu = ids.to(torch::kCPU, torch::kLong).contiguous();
  auto view = cpu.accessor<int64_t, 2>();
  for (int64_t b = 0; b < cpu.size(0); ++b)
    for (int64_t t = 0; t < cpu.size(1); ++t)
      if (view[b][t] < 0 || view[b][t] >= vocab)
        return fmt::format("{}: token id {} at sequence {}, position {} is outside the vocabulary: expected 0 to "
                           "{} (the {} tokens of {})",
                           source, view[b][t], b + 1, t + 1, vocab - 1, vocab, embedding);
  return "";
}

}  // namespace frag::cli
