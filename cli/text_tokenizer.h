//===- cli/text_tokenizer.h - Text <-> token ids for frag run --*- C++ -*-===//
//
// `frag run --prompt` tokenizes with the checkpoint's own tokenizer (the
// tokenizer/ folder that `python3 -m fragkit.checkpoint` writes beside the rank
// files), through the project's Python and Hugging Face's `tokenizers` package.
// Why Python: no C++ library in Debian's or PyPI's registries reads
// tokenizer.json (the byte-level BPE of SmolLM2, Qwen2, Llama 3); Debian's
// sentencepiece reads only tokenizer.model files. The Python process runs once
// per call, before and after the forwards, never inside them.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

namespace frag::cli {

class TextTokenizer {
 public:
  /// `folder` holds tokenizer.json (a Hugging Face tokenizer folder).
  explicit TextTokenizer(std::string folder);

  /// The tokenizer folder an import writes beside its rank files: <dir of rank_file>/tokenizer.
  static std::string folder_beside(const std::string& rank_file);

  /// int64 [B, T]; prompts of different token lengths are refused (a forward takes no padding mask).
  torch::Tensor encode(const std::vector<std::string>& prompts) const;
  /// Each prompt's ids, of any lengths (cached generation batches them: program/decoder.h).
  std::vector<std::vector<int64_t>> encode_rows(const std::vector<std::string>& prompts) const;

  /// One string per row of `ids` (int64 [B, T]), special tokens kept.
  std::vector<std::string> decode(const torch::Tensor& ids) const;

  const std::string& folder() const { return folder_; }

 private:
  std::string folder_;
};

/// The project's Python: $FRAG_PYTHON, else $FRAG_VENV/bin/python, else
/// ~/.cache/fragments/venv/bin/python where it exists, else python3 on PATH.
std::string project_python();

}  // namespace frag::cli
