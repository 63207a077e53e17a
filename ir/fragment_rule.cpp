//===- ir/fragment_rule.cpp - Fragment rules and their layout arithmetic --===//
//
// Implements the rules of fragment_rule.h: validation, the whole <-> piece
// index maps of every layout (as narrow/cat on the fragmented dim), the shape
// functions, the short descriptions and the JSON form. Every user error throws
// frag::Error (ir/error.h) naming the rule, the expected and the found values.
//
// One class per layout holds everything that layout does (its fields, checks,
// collective, shapes, whole <-> piece maps, text and JSON); `layout_of` is the
// only place that switches on LayoutKind. The public functions check what is
// common to every rule and dispatch once.
//
//===----------------------------------------------------------------------===//

#include "ir/fragment_rule.h"

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join lives here from fmt 11 on

#include <algorithm>
#include <array>
#include <ostream>
#include <utility>

#include "ir/error.h"

namespace frag::ir {
namespace {

using Json = nlohmann::json;

/// "[2, 3, 10]".
std::string shape_str(at::IntArrayRef shape) {
  return fmt::format("[{}]", fmt::join(shape.begin(), shape.end(), ", "));
}

std::string context(const FragmentRule& rule);

/// `rule.dim` normalized against a tensor of shape `shape` (`what` names it).
int64_t normalized_dim(const FragmentRule& rule, at::IntArrayRef shape, const char* what) {
  const auto rank = static_cast<int64_t>(shape.size());
  if (rank == 0 || rule.dim < -rank || rule.dim >= rank) {
    fail(
        "{}: {} shape {} (rank {}) has no dim {}; the fragmented dim must lie in "
        "[-rank, rank)",
        context(rule), what, shape_str(shape), rank, rule.dim);
  }
  return rule.dim < 0 ? rule.dim + rank : rule.dim;
}

/// A fresh contiguous copy that aliases nothing.
at::Tensor fresh(const at::Tensor& t) { return t.clone(at::MemoryFormat::Contiguous); }

/// Concatenation on `dim` as a fresh contiguous tensor.
at::Tensor cat_fresh(const std::vector<at::Tensor>& parts, int64_t dim) {
  if (parts.size() == 1) return fresh(parts[0]);
  at::Tensor out = at::cat(parts, dim);
  return out.is_contiguous() ? out : out.contiguous();
}

/// A tensor like `whole` that adds to anything without changing a bit of it:
/// -0.0 for floating dtypes, -0.0 - 0.0i for complex ones, 0 otherwise.
at::Tensor additive_identity_like(const at::Tensor& whole) {
  at::Tensor out = at::empty(whole.sizes(), whole.options());
  if (whole.is_complex()) {
    out.fill_(c10::Scalar(c10::complex<double>(-0.0, -0.0)));
  } else if (at::isFloatingType(whole.scalar_type())) {
    out.fill_(-0.0);
  } else {
    out.zero_();
  }
  return out;
}

/// ", dim N" for a rule on a dim other than -1 (describe).
std::string on_dim(const FragmentRule& rule) {
  return rule.dim == -1 ? "" : fmt::format(", dim {}", rule.dim);
}

// ----- JSON helpers -----

const Json& required(const Json& j, const char* key, const std::string& kind) {
  auto it = j.find(key);
  if (it == j.end()) {
    fail("fragment rule JSON of kind '{}' is missing field '{}' in {}", kind, key, j.dump());
  }
  return *it;
}

int64_t as_int(const Json& v, const char* key, const std::string& kind) {
  if (!v.is_number_integer()) {
    fail("fragment rule JSON of kind '{}': field '{}' must be an integer, found {} {}", kind, key,
         v.type_name(), v.dump());
  }
  return v.get<int64_t>();
}

int64_t int_field(const Json& j, const char* key, const std::string& kind) {
  return as_int(required(j, key, kind), key, kind);
}

int64_t int_field_or(const Json& j, const char* key, const std::string& kind, int64_t fallback) {
  auto it = j.find(key);
  return it == j.end() ? fallback : as_int(*it, key, kind);
}

std::string string_field(const Json& j, const char* key, const std::string& kind) {
  const Json& v = required(j, key, kind);
  if (!v.is_string()) {
    fail("fragment rule JSON of kind '{}': field '{}' must be a string, found {} {}", kind, key,
         v.type_name(), v.dump());
  }
  return v.get<std::string>();
}

// ===== the layouts =====

/// Everything one layout does. The common fields (kind, group, group_size)
/// and the checks common to every rule live in the public functions below.
class Layout {
 public:
  virtual ~Layout() = default;

  /// The JSON name ("shard").
  virtual const char* name() const = 0;
  /// The collective that turns the ranks' pieces into the whole.
  virtual CollectiveKind collective() const { return CollectiveKind::kAllGather; }
  /// JSON fields besides "kind", "group" and "group_size".
  virtual std::vector<std::string> fields() const { return {}; }
  /// Equality of the layout's own fields.
  virtual bool same_fields(const FragmentRule&, const FragmentRule&) const { return true; }
  /// Validation of the layout's own fields (`what`: "shard rule").
  virtual void check(const FragmentRule&, const std::string& /*what*/) const {}
  /// describe(): short human text.
  virtual std::string describe(const FragmentRule& rule) const = 0;
  /// Whether describe() already names the group (error contexts then leave it out).
  virtual bool describe_names_group() const { return false; }

  virtual std::vector<int64_t> whole_shape(const FragmentRule& rule, at::IntArrayRef piece) const = 0;
  virtual std::vector<int64_t> piece_shape(const FragmentRule& rule, at::IntArrayRef whole) const = 0;
  /// whole_from_pieces after the common checks (validated rule, pieces alike).
  virtual at::Tensor assemble(const FragmentRule& rule, const std::vector<at::Tensor>& pieces) const = 0;
  /// piece_of_whole after the common checks (validated rule, rank in range, whole defined).
  virtual at::Tensor cut(const FragmentRule& rule, const at::Tensor& whole, int64_t rank) const = 0;

  virtual void write_fields(const FragmentRule&, Json&) const {}
  /// Reads the layout's fields (their presence was checked against fields()).
  virtual void read_fields(const Json&, const std::string& /*kind*/, FragmentRule&) const {}
};

/// Replicated and partial sum: a piece has the whole's shape.
class SameShapeLayout : public Layout {
 public:
  std::vector<int64_t> whole_shape(const FragmentRule&, at::IntArrayRef piece) const override {
    return {piece.begin(), piece.end()};
  }
  std::vector<int64_t> piece_shape(const FragmentRule&, at::IntArrayRef whole) const override {
    return {whole.begin(), whole.end()};
  }
};

class Replicated final : public SameShapeLayout {
 public:
  const char* name() const override { return "replicated"; }
  CollectiveKind collective() const override { return CollectiveKind::kNone; }
  std::string describe(const FragmentRule&) const override { return "replicated"; }
  at::Tensor assemble(const FragmentRule&, const std::vector<at::Tensor>& pieces) const override {
    return pieces[0];
  }
  at::Tensor cut(const FragmentRule&, const at::Tensor& whole, int64_t) const override {
    return fresh(whole);
  }
};

class PartialSum final : public SameShapeLayout {
 public:
  const char* name() const override { return "partial_sum"; }
  CollectiveKind collective() const override { return CollectiveKind::kAllReduce; }
  std::string describe(const FragmentRule& rule) const override {
    return fmt::format("partial sum over {} = {}", rule.group, rule.group_size);
  }
  bool describe_names_group() const override { return true; }
  at::Tensor assemble(const FragmentRule&, const std::vector<at::Tensor>& pieces) const override {
    at::Tensor sum = fresh(pieces[0]);
    for (size_t r = 1; r < pieces.size(); ++r) sum.add_(pieces[r]);
    return sum;
  }
  at::Tensor cut(const FragmentRule&, const at::Tensor& whole, int64_t rank) const override {
    return rank == 0 ? fresh(whole) : additive_identity_like(whole);
  }
};

class Shard final : public Layout {
 public:
  const char* name() const override { return "shard"; }
  std::vector<std::string> fields() const override { return {"dim"}; }
  bool same_fields(const FragmentRule& a, const FragmentRule& b) const override { return a.dim == b.dim; }
  std::string describe(const FragmentRule& rule) const override {
    return fmt::format("shard({})", rule.dim);
  }
  std::vector<int64_t> whole_shape(const FragmentRule& rule, at::IntArrayRef piece) const override {
    std::vector<int64_t> out(piece.begin(), piece.end());
    out[normalized_dim(rule, piece, "piece")] *= rule.group_size;
    return out;
  }
  std::vector<int64_t> piece_shape(const FragmentRule& rule, at::IntArrayRef whole) const override {
    std::vector<int64_t> out(whole.begin(), whole.end());
    const int64_t d = normalized_dim(rule, whole, "whole");
    if (out[d] % rule.group_size != 0) {
      fail(
          "{}: expected a whole whose size on dim {} is a multiple of {}, found {} "
          "(whole shape {})",
          context(rule), rule.dim, rule.group_size, out[d], shape_str(whole));
    }
    out[d] /= rule.group_size;
    return out;
  }
  at::Tensor assemble(const FragmentRule& rule, const std::vector<at::Tensor>& pieces) const override {
    return cat_fresh(pieces, normalized_dim(rule, pieces[0].sizes(), "piece"));
  }
  at::Tensor cut(const FragmentRule& rule, const at::Tensor& whole, int64_t rank) const override {
    const int64_t d = normalized_dim(rule, whole.sizes(), "whole");
    const int64_t w = piece_shape(rule, whole.sizes())[d];
    return fresh(whole.narrow(d, rank * w, w));
  }
  void write_fields(const FragmentRule& rule, Json& j) const override { j["dim"] = rule.dim; }
  void read_fields(const Json& j, const std::string& kind, FragmentRule& rule) const override {
    rule.dim = int_field(j, "dim", kind);
  }
};

/// Segments, QKV and vocab shard: fixed whole and piece widths on the
/// fragmented dim, known from the rule alone.
class FixedWidthLayout : public Layout {
 public:
  virtual int64_t whole_width(const FragmentRule& rule) const = 0;
  virtual int64_t piece_width(const FragmentRule& rule) const = 0;

  std::vector<int64_t> whole_shape(const FragmentRule& rule, at::IntArrayRef piece) const override {
    std::vector<int64_t> out(piece.begin(), piece.end());
    const int64_t d = normalized_dim(rule, piece, "piece");
    const int64_t expected = piece_width(rule);
    if (out[d] != expected) {
      fail("{}: expected a piece of size {} on dim {}, found {} (piece shape {})", context(rule),
           expected, rule.dim, out[d], shape_str(piece));
    }
    out[d] = whole_width(rule);
    return out;
  }
  std::vector<int64_t> piece_shape(const FragmentRule& rule, at::IntArrayRef whole) const override {
    std::vector<int64_t> out(whole.begin(), whole.end());
    const int64_t d = normalized_dim(rule, whole, "whole");
    const int64_t expected = whole_width(rule);
    if (out[d] != expected) {
      fail("{}: expected a whole of size {} on dim {}, found {} (whole shape {})", context(rule),
           expected, rule.dim, out[d], shape_str(whole));
    }
    out[d] = piece_width(rule);
    return out;
  }
};

class Segments final : public FixedWidthLayout {
 public:
  const char* name() const override { return "segments"; }
  std::vector<std::string> fields() const override { return {"dim", "segment_sizes", "segment_names"}; }
  bool same_fields(const FragmentRule& a, const FragmentRule& b) const override {
    return a.dim == b.dim && a.segment_sizes == b.segment_sizes && a.segment_names == b.segment_names;
  }
  void check(const FragmentRule& rule, const std::string& what) const override {
    const int64_t p = rule.group_size;
    const auto& sizes = rule.segment_sizes;
    const auto& names = rule.segment_names;
    if (sizes.empty()) {
      fail("{}: segment_sizes is empty; give at least one part", what);
    }
    if (!names.empty() && names.size() != sizes.size()) {
      fail("{}: {} segment_names for {} segment_sizes; give one name per part or none", what,
           names.size(), sizes.size());
    }
    for (size_t k = 0; k < sizes.size(); ++k) {
      const std::string label = names.empty() ? fmt::format("s{}", k) : names[k];
      if (!names.empty() && names[k].empty()) {
        fail("{}: segment {} has an empty name", what, k);
      }
      if (sizes[k] < 1) {
        fail("{}: segment {} ({}) has size {}; sizes must be >= 1", what, k, label, sizes[k]);
      }
      if (sizes[k] % p != 0) {
        fail(
            "{}: segment {} ({}) has size {}, not divisible by group size {} "
            "(group '{}')",
            what, k, label, sizes[k], p, rule.group);
      }
    }
  }
  std::string describe(const FragmentRule& rule) const override {
    const bool named = rule.segment_names.size() == rule.segment_sizes.size();
    std::string out = "segments";
    for (size_t k = 0; k < rule.segment_sizes.size(); ++k) {
      const std::string name = named ? rule.segment_names[k] : fmt::format("s{}", k);
      out += fmt::format(" {}={}", name, rule.segment_sizes[k]);
    }
    return out + on_dim(rule);
  }
  int64_t whole_width(const FragmentRule& rule) const override {
    int64_t total = 0;
    for (int64_t s : rule.segment_sizes) total += s;
    return total;
  }
  int64_t piece_width(const FragmentRule& rule) const override {
    int64_t total = 0;
    for (int64_t s : rule.segment_sizes) total += s / rule.group_size;
    return total;
  }
  at::Tensor assemble(const FragmentRule& rule, const std::vector<at::Tensor>& pieces) const override {
    whole_shape(rule, pieces[0].sizes());  // checks the piece width
    const int64_t d = normalized_dim(rule, pieces[0].sizes(), "piece");
    std::vector<at::Tensor> parts;
    parts.reserve(rule.segment_sizes.size() * rule.group_size);
    int64_t offset = 0;  // o_k / P: where part k starts inside a piece
    for (int64_t size : rule.segment_sizes) {
      const int64_t w = size / rule.group_size;
      for (const at::Tensor& piece : pieces) parts.push_back(piece.narrow(d, offset, w));
      offset += w;
    }
    return cat_fresh(parts, d);
  }
  at::Tensor cut(const FragmentRule& rule, const at::Tensor& whole, int64_t rank) const override {
    piece_shape(rule, whole.sizes());  // checks the whole width
    const int64_t d = normalized_dim(rule, whole.sizes(), "whole");
    std::vector<at::Tensor> parts;
    int64_t offset = 0;  // o_k: where part k starts inside the whole
    for (int64_t size : rule.segment_sizes) {
      const int64_t w = size / rule.group_size;
      parts.push_back(whole.narrow(d, offset + rank * w, w));
      offset += size;
    }
    return cat_fresh(parts, d);
  }
  void write_fields(const FragmentRule& rule, Json& j) const override {
    j["dim"] = rule.dim;
    j["segment_sizes"] = rule.segment_sizes;
    if (!rule.segment_names.empty()) j["segment_names"] = rule.segment_names;
  }
  void read_fields(const Json& j, const std::string& kind, FragmentRule& rule) const override {
    rule.dim = int_field_or(j, "dim", kind, -1);
    const Json& sizes = required(j, "segment_sizes", kind);
    if (!sizes.is_array()) {
      fail(
          "fragment rule JSON of kind 'segments': field 'segment_sizes' must be an "
          "array of integers, found {}",
          sizes.dump());
    }
    for (const Json& s : sizes) rule.segment_sizes.push_back(as_int(s, "segment_sizes", kind));
    auto names = j.find("segment_names");
    if (names != j.end()) {
      if (!names->is_array()) {
        fail(
            "fragment rule JSON of kind 'segments': field 'segment_names' must be "
            "an array of strings, found {}",
            names->dump());
      }
      for (const Json& n : *names) {
        if (!n.is_string()) {
          fail(
              "fragment rule JSON of kind 'segments': field 'segment_names' must "
              "hold strings, found {}",
              n.dump());
        }
        rule.segment_names.push_back(n.get<std::string>());
      }
    }
  }
};

class Qkv final : public FixedWidthLayout {
 public:
  const char* name() const override { return "qkv"; }
  std::vector<std::string> fields() const override {
    return {"dim", "num_heads", "num_kv_heads", "head_size", "v_head_size"};
  }
  bool same_fields(const FragmentRule& a, const FragmentRule& b) const override {
    return a.dim == b.dim && a.num_heads == b.num_heads && a.num_kv_heads == b.num_kv_heads &&
           a.head_size == b.head_size && a.v_head_size == b.v_head_size;
  }
  void check(const FragmentRule& rule, const std::string& what) const override {
    const int64_t p = rule.group_size;
    if (rule.num_heads < 1 || rule.num_kv_heads < 1 || rule.head_size < 1 || rule.v_head_size < 1) {
      fail(
          "{}: num_heads ({}), num_kv_heads ({}), head_size ({}) and v_head_size "
          "({}) must all be >= 1",
          what, rule.num_heads, rule.num_kv_heads, rule.head_size, rule.v_head_size);
    }
    if (rule.num_heads % p != 0) {
      fail("{}: num_heads {} is not divisible by group size {} (group '{}')", what, rule.num_heads,
           p, rule.group);
    }
    const int64_t kv = rule.num_kv_heads;
    if (p >= kv ? p % kv != 0 : kv % p != 0) {
      fail(
          "{}: num_kv_heads {} and group size {} (group '{}') do not fit: when the "
          "group size is >= num_kv_heads it must be a multiple of it (kv heads are "
          "replicated), otherwise it must divide num_kv_heads",
          what, kv, p, rule.group);
    }
  }
  std::string describe(const FragmentRule& rule) const override {
    std::string out =
        fmt::format("segments q={} k={} v={}", rule.num_heads * rule.head_size,
                    rule.num_kv_heads * rule.head_size, rule.num_kv_heads * rule.v_head_size);
    if (rule.kv_replicas() > 1) out += fmt::format(", kv replicas {}", rule.kv_replicas());
    return out + on_dim(rule);
  }
  int64_t whole_width(const FragmentRule& rule) const override {
    return (rule.num_heads + rule.num_kv_heads) * rule.head_size + rule.num_kv_heads * rule.v_head_size;
  }
  int64_t piece_width(const FragmentRule& rule) const override {
    return rule.heads_per_rank() * rule.head_size +
           rule.kv_heads_per_rank() * (rule.head_size + rule.v_head_size);
  }
  at::Tensor assemble(const FragmentRule& rule, const std::vector<at::Tensor>& pieces) const override {
    whole_shape(rule, pieces[0].sizes());
    const int64_t d = normalized_dim(rule, pieces[0].sizes(), "piece");
    const int64_t q_w = rule.heads_per_rank() * rule.head_size;
    const int64_t k_w = rule.kv_heads_per_rank() * rule.head_size;
    const int64_t v_w = rule.kv_heads_per_rank() * rule.v_head_size;
    const int64_t rep = rule.kv_replicas();
    const int64_t p = rule.group_size;
    std::vector<at::Tensor> parts;
    parts.reserve(pieces.size() + 2 * static_cast<size_t>((p + rep - 1) / rep));
    for (const at::Tensor& piece : pieces) parts.push_back(piece.narrow(d, 0, q_w));
    for (int64_t r = 0; r < p; r += rep) parts.push_back(pieces[r].narrow(d, q_w, k_w));
    for (int64_t r = 0; r < p; r += rep) parts.push_back(pieces[r].narrow(d, q_w + k_w, v_w));
    return cat_fresh(parts, d);
  }
  at::Tensor cut(const FragmentRule& rule, const at::Tensor& whole, int64_t rank) const override {
    piece_shape(rule, whole.sizes());
    const int64_t d = normalized_dim(rule, whole.sizes(), "whole");
    const int64_t hs = rule.head_size;
    const int64_t vs = rule.v_head_size;
    const int64_t nh = rule.heads_per_rank();
    const int64_t nkv = rule.kv_heads_per_rank();
    const int64_t kv_index = rank / rule.kv_replicas();
    const int64_t k_start = rule.num_heads * hs;
    const int64_t v_start = k_start + rule.num_kv_heads * hs;
    return cat_fresh({whole.narrow(d, rank * nh * hs, nh * hs),
                      whole.narrow(d, k_start + kv_index * nkv * hs, nkv * hs),
                      whole.narrow(d, v_start + kv_index * nkv * vs, nkv * vs)},
                     d);
  }
  void write_fields(const FragmentRule& rule, Json& j) const override {
    j["dim"] = rule.dim;
    j["num_heads"] = rule.num_heads;
    j["num_kv_heads"] = rule.num_kv_heads;
    j["head_size"] = rule.head_size;
    j["v_head_size"] = rule.v_head_size;
  }
  void read_fields(const Json& j, const std::string& kind, FragmentRule& rule) const override {
    rule.dim = int_field_or(j, "dim", kind, -1);
    rule.num_heads = int_field(j, "num_heads", kind);
    rule.num_kv_heads = int_field(j, "num_kv_heads", kind);
    rule.head_size = int_field(j, "head_size", kind);
    rule.v_head_size = int_field_or(j, "v_head_size", kind, rule.head_size);
  }
};

class VocabShard final : public FixedWidthLayout {
 public:
  const char* name() const override { return "vocab_shard"; }
  std::vector<std::string> fields() const override { return {"dim", "org_vocab", "padded_vocab"}; }
  bool same_fields(const FragmentRule& a, const FragmentRule& b) const override {
    return a.dim == b.dim && a.org_vocab == b.org_vocab && a.padded_vocab == b.padded_vocab;
  }
  void check(const FragmentRule& rule, const std::string& what) const override {
    if (rule.org_vocab < 1) {
      fail("{}: org_vocab must be >= 1, found {}", what, rule.org_vocab);
    }
    if (rule.padded_vocab < rule.org_vocab) {
      fail("{}: padded_vocab {} is smaller than org_vocab {}", what, rule.padded_vocab,
           rule.org_vocab);
    }
    if (rule.padded_vocab % rule.group_size != 0) {
      fail(
          "{}: padded_vocab {} is not divisible by group size {} (group '{}'); "
          "FragmentRule::padded_vocab_size gives vLLM's padding",
          what, rule.padded_vocab, rule.group_size, rule.group);
    }
  }
  std::string describe(const FragmentRule& rule) const override {
    return fmt::format("vocab shard, org {}, padded {}", rule.org_vocab, rule.padded_vocab) +
           on_dim(rule);
  }
  int64_t whole_width(const FragmentRule& rule) const override { return rule.org_vocab; }
  int64_t piece_width(const FragmentRule& rule) const override {
    return rule.padded_vocab / rule.group_size;
  }
  at::Tensor assemble(const FragmentRule& rule, const std::vector<at::Tensor>& pieces) const override {
    whole_shape(rule, pieces[0].sizes());
    const int64_t d = normalized_dim(rule, pieces[0].sizes(), "piece");
    // Only the real rows of each piece: the padding is never copied.
    const int64_t w = pieces[0].size(d);
    std::vector<at::Tensor> parts;
    for (int64_t r = 0; r < rule.group_size && r * w < rule.org_vocab; ++r)
      parts.push_back(pieces[r].narrow(d, 0, std::min(w, rule.org_vocab - r * w)));
    return cat_fresh(parts, d);
  }
  at::Tensor cut(const FragmentRule& rule, const at::Tensor& whole, int64_t rank) const override {
    piece_shape(rule, whole.sizes());
    const int64_t d = normalized_dim(rule, whole.sizes(), "whole");
    const int64_t w = rule.padded_vocab / rule.group_size;
    const int64_t start = rank * w;
    const int64_t real = std::clamp<int64_t>(rule.org_vocab - start, 0, w);
    std::vector<at::Tensor> parts;
    if (real > 0) parts.push_back(whole.narrow(d, start, real));
    if (real < w) {
      std::vector<int64_t> pad_shape(whole.sizes().begin(), whole.sizes().end());
      pad_shape[d] = w - real;
      parts.push_back(at::zeros(pad_shape, whole.options()));
    }
    return cat_fresh(parts, d);
  }
  void write_fields(const FragmentRule& rule, Json& j) const override {
    j["dim"] = rule.dim;
    j["org_vocab"] = rule.org_vocab;
    j["padded_vocab"] = rule.padded_vocab;
  }
  void read_fields(const Json& j, const std::string& kind, FragmentRule& rule) const override {
    rule.dim = int_field_or(j, "dim", kind, -1);
    rule.org_vocab = int_field(j, "org_vocab", kind);
    rule.padded_vocab = int_field(j, "padded_vocab", kind);
  }
};

/// Every layout, in LayoutKind order.
constexpr std::array<LayoutKind, 6> kKinds = {LayoutKind::kReplicated, LayoutKind::kShard,
                                              LayoutKind::kSegments,   LayoutKind::kQkv,
                                              LayoutKind::kPartialSum, LayoutKind::kVocabShard};

/// The layout of a kind, or nullptr for a value outside the enum. The one
/// switch on LayoutKind.
const Layout* find_layout(LayoutKind kind) {
  static const Replicated replicated;
  static const Shard shard;
  static const Segments segments;
  static const Qkv qkv;
  static const PartialSum partial_sum;
  static const VocabShard vocab_shard;
  switch (kind) {
    case LayoutKind::kReplicated: return &replicated;
    case LayoutKind::kShard: return &shard;
    case LayoutKind::kSegments: return &segments;
    case LayoutKind::kQkv: return &qkv;
    case LayoutKind::kPartialSum: return &partial_sum;
    case LayoutKind::kVocabShard: return &vocab_shard;
  }
  return nullptr;
}

/// The layout of a rule; throws on a kind outside the enum.
const Layout& layout_of(const FragmentRule& rule) {
  const Layout* layout = find_layout(rule.kind);
  if (layout == nullptr) fail("fragment rule has unknown kind {}", static_cast<int>(rule.kind));
  return *layout;
}

/// The rule and its group, for error messages: "shard(-1) over tp = 4".
std::string context(const FragmentRule& rule) {
  const Layout* layout = find_layout(rule.kind);
  if (layout != nullptr && layout->describe_names_group()) return describe(rule);
  return fmt::format("{} over {} = {}", describe(rule), rule.group, rule.group_size);
}

/// Checks the rank argument of piece_of_whole.
void check_rank(const FragmentRule& rule, int64_t rank) {
  if (rank < 0 || rank >= rule.group_size) {
    fail("{}: rank {} is out of range; expected 0 <= rank < {}", context(rule), rank,
         rule.group_size);
  }
}

/// Checks the list given to whole_from_pieces: count, and all pieces alike.
void check_pieces(const FragmentRule& rule, const std::vector<at::Tensor>& pieces) {
  if (pieces.empty()) fail("{}: no pieces given", context(rule));
  // A rule with no collective holds the whole on every rank: any number of copies will do.
  if (layout_of(rule).collective() != CollectiveKind::kNone &&
      static_cast<int64_t>(pieces.size()) != rule.group_size) {
    fail("{}: expected {} pieces (one per rank of group '{}', in rank order), found {}",
         context(rule), rule.group_size, rule.group, pieces.size());
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (!pieces[i].defined()) fail("{}: piece {} is undefined", context(rule), i);
  }
  const at::Tensor& first = pieces[0];
  for (size_t i = 1; i < pieces.size(); ++i) {
    const at::Tensor& p = pieces[i];
    if (p.sizes() != first.sizes()) {
      fail(
          "{}: piece {} has shape {} but piece 0 has shape {}; all pieces must have "
          "the same shape",
          context(rule), i, shape_str(p.sizes()), shape_str(first.sizes()));
    }
    if (p.scalar_type() != first.scalar_type()) {
      fail("{}: piece {} has dtype {} but piece 0 has dtype {}", context(rule), i,
           c10::toString(p.scalar_type()), c10::toString(first.scalar_type()));
    }
    if (p.device() != first.device()) {
      fail("{}: piece {} is on {} but piece 0 is on {}", context(rule), i, p.device().str(),
           first.device().str());
    }
  }
}

}  // namespace

// ===== FragmentRule =====

FragmentRule FragmentRule::replicated(std::string group, int64_t group_size) {
  FragmentRule rule;
  rule.kind = LayoutKind::kReplicated;
  rule.group = std::move(group);
  rule.group_size = group_size;
  validate(rule);
  return rule;
}

FragmentRule FragmentRule::shard(int64_t dim, std::string group, int64_t group_size) {
  FragmentRule rule;
  rule.kind = LayoutKind::kShard;
  rule.dim = dim;
  rule.group = std::move(group);
  rule.group_size = group_size;
  validate(rule);
  return rule;
}

FragmentRule FragmentRule::segments(std::vector<int64_t> sizes, std::vector<std::string> names,
                                    std::string group, int64_t group_size) {
  FragmentRule rule;
  rule.kind = LayoutKind::kSegments;
  rule.segment_sizes = std::move(sizes);
  rule.segment_names = std::move(names);
  rule.group = std::move(group);
  rule.group_size = group_size;
  validate(rule);
  return rule;
}

FragmentRule FragmentRule::qkv(int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                               int64_t v_head_size, std::string group, int64_t group_size) {
  FragmentRule rule;
  rule.kind = LayoutKind::kQkv;
  rule.num_heads = num_heads;
  rule.num_kv_heads = num_kv_heads;
  rule.head_size = head_size;
  rule.v_head_size = v_head_size;
  rule.group = std::move(group);
  rule.group_size = group_size;
  validate(rule);
  return rule;
}

FragmentRule FragmentRule::partial_sum(std::string group, int64_t group_size) {
  FragmentRule rule;
  rule.kind = LayoutKind::kPartialSum;
  rule.group = std::move(group);
  rule.group_size = group_size;
  validate(rule);
  return rule;
}

FragmentRule FragmentRule::vocab_shard(int64_t org_vocab, int64_t padded_vocab, std::string group,
                                       int64_t group_size) {
  FragmentRule rule;
  rule.kind = LayoutKind::kVocabShard;
  rule.org_vocab = org_vocab;
  rule.padded_vocab = padded_vocab;
  rule.group = std::move(group);
  rule.group_size = group_size;
  validate(rule);
  return rule;
}

int64_t FragmentRule::padded_vocab_size(int64_t vocab, int64_t tp, int64_t pad) {
  if (vocab < 1 || tp < 1 || pad < 1) {
    fail("padded_vocab_size: vocab ({}), tp ({}) and pad ({}) must all be >= 1", vocab, tp, pad);
  }
  const int64_t padded = (vocab + pad - 1) / pad * pad;
  if (padded % tp != 0) {
    fail(
        "padded_vocab_size: vocab {} padded to a multiple of {} is {}, which is not "
        "divisible by tp {} (vLLM asserts the same)",
        vocab, pad, padded, tp);
  }
  return padded;
}

int64_t FragmentRule::heads_per_rank() const { return group_size > 0 ? num_heads / group_size : 0; }

int64_t FragmentRule::kv_heads_per_rank() const {
  if (group_size <= 0) return 0;
  return group_size >= num_kv_heads ? 1 : num_kv_heads / group_size;
}

int64_t FragmentRule::kv_replicas() const {
  if (num_kv_heads <= 0 || group_size < num_kv_heads) return 1;
  return group_size / num_kv_heads;
}

bool operator==(const FragmentRule& a, const FragmentRule& b) {
  if (a.kind != b.kind || a.group != b.group || a.group_size != b.group_size) return false;
  const Layout* layout = find_layout(a.kind);
  return layout != nullptr && layout->same_fields(a, b);
}

bool operator!=(const FragmentRule& a, const FragmentRule& b) { return !(a == b); }

std::ostream& operator<<(std::ostream& os, const FragmentRule& rule) {
  return os << to_json(rule).dump();
}

const char* kind_name(LayoutKind kind) {
  const Layout* layout = find_layout(kind);
  return layout != nullptr ? layout->name() : "unknown";
}

// ===== validate =====

void validate(const FragmentRule& rule) {
  const std::string what = fmt::format("{} rule", kind_name(rule.kind));
  const int64_t p = rule.group_size;
  if (rule.group.empty()) fail("{}: group name is empty; use e.g. \"tp\"", what);
  if (p < 1) {
    fail("{}: group_size must be >= 1, found {} (group '{}')", what, p, rule.group);
  }
  layout_of(rule).check(rule, what);
}

CollectiveKind collective_for(const FragmentRule& rule) { return layout_of(rule).collective(); }

const char* collective_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kNone: return "none";
  }
  return "unknown";
}

bool piece_is_whole(const FragmentRule& rule) {
  validate(rule);
  if (rule.group_size != 1) return false;
  return rule.kind != LayoutKind::kVocabShard || rule.org_vocab == rule.padded_vocab;
}

// ===== shapes =====

std::vector<int64_t> whole_shape(const FragmentRule& rule, at::IntArrayRef piece_shape) {
  validate(rule);
  return layout_of(rule).whole_shape(rule, piece_shape);
}

std::vector<int64_t> piece_shape(const FragmentRule& rule, at::IntArrayRef whole_shape) {
  validate(rule);
  return layout_of(rule).piece_shape(rule, whole_shape);
}

// ===== whole <-> pieces =====

torch::Tensor whole_from_pieces(const FragmentRule& rule,
                                const std::vector<torch::Tensor>& pieces) {
  validate(rule);
  check_pieces(rule, pieces);
  return layout_of(rule).assemble(rule, pieces);
}

torch::Tensor piece_of_whole(const FragmentRule& rule, const torch::Tensor& whole, int64_t rank) {
  validate(rule);
  check_rank(rule, rank);
  if (!whole.defined()) fail("{}: the whole is undefined", context(rule));
  return layout_of(rule).cut(rule, whole, rank);
}

// ===== describe =====

std::string describe(const FragmentRule& rule) {
  const Layout* layout = find_layout(rule.kind);
  if (layout == nullptr) return fmt::format("unknown layout kind {}", static_cast<int>(rule.kind));
  return layout->describe(rule);
}

// ===== JSON =====

nlohmann::json to_json(const FragmentRule& rule) {
  Json j;
  j["kind"] = kind_name(rule.kind);
  j["group"] = rule.group;
  j["group_size"] = rule.group_size;
  if (const Layout* layout = find_layout(rule.kind)) layout->write_fields(rule, j);
  return j;
}

FragmentRule rule_from_json(const nlohmann::json& j) {
  if (!j.is_object()) {
    fail("fragment rule JSON must be an object, found {} {}", j.type_name(), j.dump());
  }
  auto kind_it = j.find("kind");
  if (kind_it == j.end() || !kind_it->is_string()) {
    fail(
        "fragment rule JSON needs a string field 'kind' (one of replicated, shard, "
        "segments, qkv, partial_sum, vocab_shard), found {}",
        j.dump());
  }
  const std::string kind = kind_it->get<std::string>();
  FragmentRule rule;
  const Layout* layout = nullptr;
  for (LayoutKind k : kKinds) {
    if (kind == kind_name(k)) {
      rule.kind = k;
      layout = find_layout(k);
    }
  }
  if (layout == nullptr) {
    fail(
        "fragment rule JSON has unknown kind '{}'; expected one of replicated, shard, "
        "segments, qkv, partial_sum, vocab_shard",
        kind);
  }

  std::vector<std::string> allowed = layout->fields();
  allowed.insert(allowed.end(), {"kind", "group", "group_size"});
  for (const auto& item : j.items()) {
    if (std::find(allowed.begin(), allowed.end(), item.key()) == allowed.end()) {
      fail(
          "fragment rule JSON of kind '{}' has field '{}', which does not belong to "
          "that kind; allowed: {}",
          kind, item.key(), fmt::join(allowed, ", "));
    }
  }

  rule.group = string_field(j, "group", kind);
  rule.group_size = int_field(j, "group_size", kind);
  layout->read_fields(j, kind, rule);
  validate(rule);
  return rule;
}

void to_json(nlohmann::json& j, const FragmentRule& rule) { j = to_json(rule); }

void from_json(const nlohmann::json& j, FragmentRule& rule) { rule = rule_from_json(j); }

}  // namespace frag::ir
