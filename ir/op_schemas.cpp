//===- ir/op_schemas.cpp - Registers the frag:: op schemas ---------------===//
#include "ir/op_schemas.h"

#include <torch/library.h>

namespace frag::ir {
namespace {

/// Strips "frag::" for TORCH_LIBRARY's def, which adds the namespace itself.
const char* unqualified(const char* schema) { return schema + 6; }

}  // namespace

TORCH_LIBRARY(frag, m) {
  for (const char* schema :
       {kAllReduceSchema, kAllGatherSchema, kGatherSchema, kInterveneSchema, kSplitSchema, kGatherAtSchema,
        kInterveneAtSchema, kSplitAtSchema, kAllReduceGroupSchema, kAllGatherGroupSchema, kRmsNormSchema,
        kRotaryEmbeddingSchema, kSiluAndMulSchema})
    m.def(unqualified(schema));
}

}  // namespace frag::ir
