//===- tools/token_ids.h - Read token ids from text --------------*- C++ -*-===//
#pragma once

#include <torch/torch.h>

#include <string>

namespace frag::tools {

/// Reads ids.txt: one sequence per line, ids separated by spaces, every line
/// the same length. Returns int64 [B, T]. Bad input: frag::Error with file and line.
torch::Tensor read_token_ids(const std::string& path);

}  // namespace frag::tools
