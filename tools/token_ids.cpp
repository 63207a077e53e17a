//===- tools/token_ids.cpp - Read token ids from text --------------------===//
#include "tools/token_ids.h"

#include "ir/error.h"

#include <fstream>
#include <sstream>
#include <vector>

namespace frag::tools {

torch::Tensor read_token_ids(const std::string& path) {
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

}  // namespace frag::tools
