//===- tests/passes/pass_fixtures.h - Small layer modules for pass tests -*- C++ -*-===//
//
// Builds TorchScript modules that look like the export kit's layers
// (fragkit/layers.py): the class name, the config attributes of
// CONTRACT_ATTRIBUTES with vLLM's values for the given sizes, per-rank weights
// and a small forward with the layer's collectives (frag::all_reduce /
// frag::all_gather under the same config conditions as the kit). Forwards
// are simplified (no bias, no routing), but keep the signature and the
// (output, output_bias) tuple of the linear layers.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/csrc/jit/frontend/sugared_value.h>
#include <torch/script.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace frag::passes::testing {

using torch::jit::Module;

/// Qualified name prefix of the kit's layer classes.
inline const std::string kLayerPrefix = "__torch__.fragkit.layers.";

/// `torch.ops.<ns>`: each attribute is the builtin op namespace <ns>.
struct OpsNamespaces : torch::jit::SugaredValue {
  std::string kind() const override { return "torch.ops"; }
  std::shared_ptr<torch::jit::SugaredValue> attr(const torch::jit::SourceRange&,
                                                 torch::jit::GraphFunction&,
                                                 const std::string& field) override {
    return std::make_shared<torch::jit::BuiltinModule>(field);
  }
};

/// `torch`: aten builtins, plus `torch.ops` (C++'s native resolver has no
/// `torch.ops`, which the kit's layers use for frag::all_reduce / all_gather).
struct TorchWithOps : torch::jit::BuiltinModule {
  TorchWithOps() : BuiltinModule("aten") {}
  std::shared_ptr<torch::jit::SugaredValue> attr(const torch::jit::SourceRange& loc,
                                                 torch::jit::GraphFunction& m,
                                                 const std::string& field) override {
    if (field == "ops") return std::make_shared<OpsNamespaces>();
    return BuiltinModule::attr(loc, m, field);
  }
};

struct ResolverWithOps : torch::jit::Resolver {
  std::shared_ptr<torch::jit::SugaredValue> resolveValue(const std::string& name,
                                                         torch::jit::GraphFunction&,
                                                         const torch::jit::SourceRange&) override {
    if (name == "torch") return std::make_shared<TorchWithOps>();
    return nullptr;
  }
  c10::TypePtr resolveType(const std::string&, const torch::jit::SourceRange&) override {
    return nullptr;
  }
};

/// Compiles TorchScript `source` into `m`, with `torch.ops.frag.*` available.
/// The graph of `m.forward` (the pass tests' IR in and out).
inline std::shared_ptr<torch::jit::Graph> forward_graph(const Module& m) {
  return torch::jit::toGraphFunction(m.get_method("forward").function()).graph();
}

inline void define(Module& m, const std::string& source) {
  m.define(source, std::make_shared<ResolverWithOps>());
}

inline Module make_module(const std::string& qualified_name) {
  return Module(c10::QualifiedName(qualified_name));
}

inline void set_int(Module& m, const std::string& name, int64_t value) {
  m.register_attribute(name, c10::IntType::get(), value);
}

inline void set_bool(Module& m, const std::string& name, bool value) {
  m.register_attribute(name, c10::BoolType::get(), value);
}

inline void set_ints(Module& m, const std::string& name, const std::vector<int64_t>& values) {
  m.register_attribute(name, c10::ListType::ofInts(), c10::List<int64_t>(values));
}

inline void set_weight(Module& m, const std::string& name, std::vector<int64_t> shape) {
  m.register_parameter(name, torch::randn(shape), false);
}

/// The attributes every kit linear layer carries (_LINEAR_ATTRS).
inline void set_linear_attrs(Module& m, int64_t tp, int64_t rank, int64_t in, int64_t out,
                             int64_t in_p, int64_t out_p) {
  set_int(m, "tp_size", tp);
  set_int(m, "tp_rank", rank);
  set_int(m, "input_size", in);
  set_int(m, "output_size", out);
  set_int(m, "input_size_per_partition", in_p);
  set_int(m, "output_size_per_partition", out_p);
  set_bool(m, "skip_bias_add", false);
}

/// Column-style forward: rank-local matmul, all-gather when gather_output.
inline const char* kColumnForward = R"(
def forward(self, x):
    out = torch.linear(x, self.weight)
    if self.gather_output and self.tp_size > 1:
        out = torch.ops.frag.all_gather(out, -1, "tp")
    return (out, None)
)";

inline Module column(int64_t tp, int64_t rank, int64_t in, int64_t out, bool gather_output = false,
                     const std::string& qualified_name = kLayerPrefix + "ColumnParallelLinear") {
  Module m = make_module(qualified_name);
  set_linear_attrs(m, tp, rank, in, out, in, out / tp);
  set_bool(m, "gather_output", gather_output);
  set_weight(m, "weight", {out / tp, in});
  define(m, kColumnForward);
  return m;
}

inline Module merged(int64_t tp, int64_t rank, int64_t in, const std::vector<int64_t>& sizes) {
  Module m = make_module(kLayerPrefix + "MergedColumnParallelLinear");
  int64_t out = 0;
  for (auto s : sizes) out += s;
  set_linear_attrs(m, tp, rank, in, out, in, out / tp);
  set_bool(m, "gather_output", false);
  set_ints(m, "output_sizes", sizes);
  set_weight(m, "weight", {out / tp, in});
  define(m, kColumnForward);
  return m;
}

/// vLLM's QKVParallelLinear numbers for `heads` q / `kv_heads` kv heads at `tp`.
inline Module qkv(int64_t tp, int64_t rank, int64_t hidden, int64_t head_size, int64_t heads,
                  int64_t kv_heads, int64_t v_head_size = 0,
                  const std::string& qualified_name = kLayerPrefix + "QKVParallelLinear") {
  if (v_head_size == 0) v_head_size = head_size;
  const int64_t nh = heads / tp;
  const int64_t nkv = tp >= kv_heads ? 1 : kv_heads / tp;
  const int64_t replicas = tp >= kv_heads ? tp / kv_heads : 1;
  const int64_t per_rank = nh * head_size + nkv * head_size + nkv * v_head_size;
  // vLLM's output_size counts the kv replicas.
  const int64_t output_size = per_rank * tp;
  Module m = make_module(qualified_name);
  set_linear_attrs(m, tp, rank, hidden, output_size, hidden, per_rank);
  set_bool(m, "gather_output", false);
  set_ints(m, "output_sizes", {nh * head_size * tp, nkv * head_size * tp, nkv * v_head_size * tp});
  set_int(m, "hidden_size", hidden);
  set_int(m, "head_size", head_size);
  set_int(m, "v_head_size", v_head_size);
  set_int(m, "total_num_heads", heads);
  set_int(m, "total_num_kv_heads", kv_heads);
  set_int(m, "num_heads", nh);
  set_int(m, "num_kv_heads", nkv);
  set_int(m, "num_kv_head_replicas", replicas);
  set_weight(m, "weight", {per_rank, hidden});
  define(m, kColumnForward);
  return m;
}

inline Module row(int64_t tp, int64_t rank, int64_t in, int64_t out, bool input_is_parallel = true,
                  bool reduce_results = true,
                  const std::string& qualified_name = kLayerPrefix + "RowParallelLinear") {
  Module m = make_module(qualified_name);
  set_linear_attrs(m, tp, rank, in, out, in / tp, out);
  set_bool(m, "input_is_parallel", input_is_parallel);
  set_bool(m, "reduce_results", reduce_results);
  set_weight(m, "weight", {out, in / tp});
  define(m, R"(
def forward(self, x):
    if self.input_is_parallel:
        xp = x
    else:
        xp = x.narrow(-1, self.tp_rank * self.input_size_per_partition, self.input_size_per_partition)
    out = torch.linear(xp, self.weight)
    if self.reduce_results:
        out = torch.ops.frag.all_reduce(out, "tp")
    return (out, None)
)");
  return m;
}

inline Module replicated(int64_t in, int64_t out) {
  Module m = make_module(kLayerPrefix + "ReplicatedLinear");
  set_linear_attrs(m, 1, 0, in, out, in, out);
  set_weight(m, "weight", {out, in});
  define(m, R"(
def forward(self, x):
    return (torch.linear(x, self.weight), None)
)");
  return m;
}

/// vLLM's padded vocab: ceil(V / 64) * 64 (no added vocabulary).
inline int64_t padded_vocab(int64_t vocab) { return (vocab + 63) / 64 * 64; }

inline void set_vocab_attrs(Module& m, int64_t tp, int64_t rank, int64_t vocab, int64_t dim) {
  const int64_t padded = padded_vocab(vocab);
  set_int(m, "tp_size", tp);
  set_int(m, "tp_rank", rank);
  set_int(m, "num_embeddings", vocab);
  set_int(m, "org_vocab_size", vocab);
  set_int(m, "num_embeddings_padded", padded);
  set_int(m, "num_embeddings_per_partition", padded / tp);
  set_int(m, "vocab_start_index", rank * padded / tp);
  set_int(m, "vocab_end_index", (rank + 1) * padded / tp);
  set_int(m, "padding_size", 64);
  set_int(m, "embedding_dim", dim);
  set_weight(m, "weight", {padded / tp, dim});
}

inline Module vocab_embedding(int64_t tp, int64_t rank, int64_t vocab, int64_t dim) {
  Module m = make_module(kLayerPrefix + "VocabParallelEmbedding");
  set_vocab_attrs(m, tp, rank, vocab, dim);
  define(m, R"(
def forward(self, ids):
    out = torch.embedding(self.weight, ids)
    if self.tp_size > 1:
        out = torch.ops.frag.all_reduce(out, "tp")
    return out
)");
  return m;
}

inline Module lm_head(int64_t tp, int64_t rank, int64_t vocab, int64_t dim) {
  Module m = make_module(kLayerPrefix + "ParallelLMHead");
  set_vocab_attrs(m, tp, rank, vocab, dim);
  define(m, R"(
def forward(self, h):
    return torch.linear(h, self.weight)
)");
  return m;
}

inline Module logits_processor(int64_t tp, int64_t vocab) {
  Module m = make_module(kLayerPrefix + "LogitsProcessor");
  set_int(m, "vocab_size", vocab);
  set_int(m, "org_vocab_size", vocab);
  set_int(m, "tp_size", tp);
  define(m, R"(
def forward(self, logits):
    if self.tp_size > 1:
        logits = torch.ops.frag.all_gather(logits, -1, "tp")
    return logits[..., :self.org_vocab_size]
)");
  return m;
}

inline Module fused_moe(int64_t tp, int64_t rank, int64_t ep, int64_t ep_rank, int64_t experts,
                        int64_t hidden, int64_t inter, bool reduce_results) {
  Module m = make_module(kLayerPrefix + "FusedMoE");
  const int64_t local = experts / ep;
  set_int(m, "num_experts", experts);
  set_int(m, "top_k", 2);
  set_int(m, "hidden_size", hidden);
  set_int(m, "intermediate_size", inter);
  set_int(m, "intermediate_size_per_partition", inter / tp);
  set_int(m, "tp_size", tp);
  set_int(m, "tp_rank", rank);
  set_int(m, "ep_size", ep);
  set_int(m, "ep_rank", ep_rank);
  set_int(m, "local_num_experts", local);
  set_int(m, "expert_start", ep_rank * local);
  set_bool(m, "reduce_results", reduce_results);
  set_bool(m, "renormalize", true);
  set_weight(m, "w13_weight", {local, 2 * inter / tp, hidden});
  set_weight(m, "w2_weight", {local, hidden, inter / tp});
  // Stands in for the expert mix: a rank-local function of the input.
  define(m, R"(
def forward(self, hidden_states, router_logits):
    out = hidden_states * 2.0 + router_logits.sum(-1, keepdim=True)
    if self.reduce_results and self.tp_size * self.ep_size > 1:
        if self.ep_size > 1:
            out = torch.ops.frag.all_reduce(out, "ep")
        else:
            out = torch.ops.frag.all_reduce(out, "tp")
    return out
)");
  return m;
}

/// A module of a non-layer class with `forward` source `source`.
inline Module plain(const std::string& qualified_name, const std::string& source) {
  Module m = make_module(qualified_name);
  define(m, source);
  return m;
}

/// A root holding `children` (in order) with no forward.
inline Module holder(const std::vector<std::pair<std::string, Module>>& children,
                     const std::string& qualified_name = "__torch__.Root") {
  Module root = make_module(qualified_name);
  for (const auto& [name, child] : children) root.register_module(name, child);
  return root;
}

inline const char* kActSource = "def forward(self, x):\n    return torch.relu(x)\n";

/// root.forward: x → up (Column, tp 2) → act (relu) → down (Row, input parallel,
/// reduce_results False) → [0].
inline Module column_act_row(int64_t rank = 0) {
  Module root = holder({{"up", column(2, rank, 8, 16)},
                        {"act", plain("__torch__.Act", kActSource)},
                        {"down", row(2, rank, 16, 8, /*input_is_parallel=*/true, /*reduce_results=*/false)}});
  define(root, R"(
def forward(self, x):
    h = self.up.forward(x)[0]
    a = self.act.forward(h)
    return self.down.forward(a)[0]
)");
  return root;
}

}  // namespace frag::passes::testing
