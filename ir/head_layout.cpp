//===- ir/head_layout.cpp - Attention heads on a location's last dim -----===//
#include "ir/head_layout.h"

namespace frag::ir {
namespace {

/// The attribute, or 0 where it is missing (callers treat 0 as "no heads").
int64_t integer(const IntAttributes& attributes, const char* name) {
  auto it = attributes.find(name);
  return it == attributes.end() ? 0 : it->second;
}

}  // namespace

HeadLayout qkv_output_heads(const IntAttributes& qkv) {
  const int64_t heads = integer(qkv, "total_num_heads"), kv_heads = integer(qkv, "total_num_kv_heads");
  const int64_t head_size = integer(qkv, "head_size"), v_head_size = integer(qkv, "v_head_size");
  if (heads <= 0 || kv_heads <= 0 || head_size <= 0 || v_head_size <= 0) return {};
  const int64_t q = heads * head_size, k = kv_heads * head_size, v = kv_heads * v_head_size;
  return {{"q", 0, q, head_size}, {"k", q, q + k, head_size}, {"v", q + k, q + k + v, v_head_size}};
}

HeadLayout attention_output_heads(const IntAttributes& qkv) {
  const int64_t heads = integer(qkv, "total_num_heads"), v_head_size = integer(qkv, "v_head_size");
  if (heads <= 0 || v_head_size <= 0) return {};
  return {{"heads", 0, heads * v_head_size, v_head_size}};
}

HeadLayout head_layout(const FragmentTable& table, const std::string& location,
                       const std::function<IntAttributes(const std::string& path)>& attributes) {
  const auto dot = location.rfind('.');
  if (dot == std::string::npos) return {};
  const std::string path = location.substr(0, dot), side = location.substr(dot + 1);
  const LayerEntry* layer = table.layer(path);
  if (!layer) return {};
  if (side == "output" && layer->kind == "QKVParallelLinear") return qkv_output_heads(attributes(path));
  if (side == "input" && layer->kind == "RowParallelLinear") {
    // o_proj: its input is the attention's output, laid out in the heads of the qkv_proj beside it.
    const auto parent = path.rfind('.');
    const std::string qkv = path.substr(0, parent == std::string::npos ? 0 : parent) + ".qkv_proj";
    const LayerEntry* sibling = table.layer(qkv);
    if (sibling && sibling->kind == "QKVParallelLinear") return attention_output_heads(attributes(qkv));
  }
  return {};
}

}  // namespace frag::ir
