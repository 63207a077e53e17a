//===- runtime/forward_arguments.h - A forward with more than token ids -*- C++ -*-===//
//
// A rank file whose forward takes a KV cache (the kit's models since the
// cached-generation change) is called as forward(input_ids, positions,
// kv_cache, cache_len); run_forward(rank, ids) still calls it with its
// defaults. Kept apart from rank_module.h, which much of the tree includes.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "runtime/rank_module.h"

#include <vector>

namespace frag::runtime {

/// run_forward with the arguments after input_ids (`extra`, in forward's order); arguments neither
/// given nor in `extra` take forward's defaults. `forward` as in run_forward.
torch::Tensor run_forward_with(RankModule& rank_module, const torch::Tensor& input_ids,
                               const std::vector<c10::IValue>& extra, torch::jit::Function* forward = nullptr);

}  // namespace frag::runtime
