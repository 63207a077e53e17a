//===- ir/op_schemas.h - The frag:: op schemas: the pass/runtime contract -*- C++ -*-===//
//
// Exported models call frag::all_reduce and frag::all_gather for their own
// tensor-parallel communication. The fragment pass inserts frag::gather,
// frag::intervene and frag::split around module boundaries; the runtime
// implements all five. The schemas are registered once, here (op_schemas.cpp,
// schema only, no kernels), so a process that only rewrites or inspects
// graphs can save and load them; runtime/ registers the kernels.
// fragkit/ops.py defines the same model ops for Python.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <ATen/core/interned_strings.h>

namespace frag::ir {

/// Sum over a named group, out of place.
inline constexpr const char* kAllReduceSchema = "frag::all_reduce(Tensor x, str group) -> Tensor";
/// Concatenation of every rank's tensor along `dim`, in group-rank order.
inline constexpr const char* kAllGatherSchema =
    "frag::all_gather(Tensor x, int dim, str group) -> Tensor";
/// At a fragmented location: the whole tensor if an intervention waits on
/// this visit, else `piece` itself (no collective, no copy). `rule` is the
/// location's fragment rule as JSON.
inline constexpr const char* kGatherSchema =
    "frag::gather(Tensor(a) piece, str location, str rule) -> Tensor(a)";
/// Runs the interventions waiting at `location` on this visit. `fragmented`
/// says whether a frag::gather came first (it opens the visit) or not (this
/// op opens it).
inline constexpr const char* kInterveneSchema =
    "frag::intervene(Tensor(a) value, str location, bool fragmented) -> Tensor(a)";
/// At a fragmented location: `piece` itself if nothing was edited on this
/// visit, else this rank's piece of the edited whole `value`.
inline constexpr const char* kSplitSchema =
    "frag::split(Tensor value, Tensor(a) piece, str location, str rule) -> Tensor(a)";

/// The same three ops bound to a location id (ir/location_table.h): the form
/// a loaded program runs (passes/bind_location_ids rewrites the file's form
/// into it at load). Files keep the string form: readable, and independent of
/// how ids are numbered.
inline constexpr const char* kGatherAtSchema = "frag::gather.at(Tensor(a) piece, int location) -> Tensor(a)";
inline constexpr const char* kInterveneAtSchema =
    "frag::intervene.at(Tensor(a) value, int location, bool fragmented) -> Tensor(a)";
inline constexpr const char* kSplitAtSchema =
    "frag::split.at(Tensor value, Tensor(a) piece, int location) -> Tensor(a)";

/// The model's collectives bound to a group id (ir/group_id.h): the form a loaded program runs
/// (passes/bind_group_ids rewrites the file's form into it at load).
inline constexpr const char* kAllReduceGroupSchema = "frag::all_reduce.group(Tensor x, int group) -> Tensor";
inline constexpr const char* kAllGatherGroupSchema =
    "frag::all_gather.group(Tensor x, int dim, int group) -> Tensor";

/// The kit's layer math as ops (runtime/layer_ops.cpp; CUDA kernels in layer_ops_cuda.cu), so that an
/// exported model and its rewritten graph run the same fused kernels wherever fragment ops sit (issue 31).
/// RMSNorm: x / sqrt(mean(x^2) + eps), computed in float32, rounded to x's dtype, times weight.
inline constexpr const char* kRmsNormSchema = "frag::rms_norm(Tensor x, Tensor weight, float eps) -> Tensor";
/// Rotary position embedding of query and key (neox: rotate halves; else interleaved pairs), out of
/// place: cos_sin_cache [max positions, rotary_dim] holds cos | sin; positions [T] or [B, T].
inline constexpr const char* kRotaryEmbeddingSchema =
    "frag::rotary_embedding(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, int head_size, "
    "int rotary_dim, bool is_neox) -> (Tensor, Tensor)";
/// [g | u] -> silu(g) * u over the last dimension.
inline constexpr const char* kSiluAndMulSchema = "frag::silu_and_mul(Tensor x) -> Tensor";

/// Qualified names, for building and matching nodes.
inline constexpr const char* kAllReduceOp = "frag::all_reduce";
inline constexpr const char* kAllGatherOp = "frag::all_gather";
inline constexpr const char* kGatherOp = "frag::gather";
inline constexpr const char* kInterveneOp = "frag::intervene";
inline constexpr const char* kSplitOp = "frag::split";

/// The node kinds, interned once for every pass that builds or matches them.
inline const c10::Symbol kAllReduceKind = c10::Symbol::fromQualString(kAllReduceOp);
inline const c10::Symbol kAllGatherKind = c10::Symbol::fromQualString(kAllGatherOp);
inline const c10::Symbol kGatherKind = c10::Symbol::fromQualString(kGatherOp);
inline const c10::Symbol kInterveneKind = c10::Symbol::fromQualString(kInterveneOp);
inline const c10::Symbol kSplitKind = c10::Symbol::fromQualString(kSplitOp);
/// frag::gather, frag::intervene or frag::split (either form).
inline bool is_fragment_op(c10::Symbol kind) {
  return kind == kGatherKind || kind == kInterveneKind || kind == kSplitKind;
}

}  // namespace frag::ir
