#pragma once
// FNV-1a (64 bit): the one digest fragments uses to compare values across ranks and processes of one build
// (plans, rule tables, callables' results, token ids). Not for security, and not stored in files: a change
// here changes no file format, only what ranks of the same build exchange.

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace frag::ir {

inline constexpr uint64_t kFnvOffsetBasis = 14695981039346656037ull;
inline constexpr uint64_t kFnvPrime = 1099511628211ull;

/// Folds `size` bytes at `data` into `hash` (start from kFnvOffsetBasis; chain calls to digest several parts).
/// (Named apart from the text overload: fnv1a("text", hash) must never read `hash` bytes.)
inline uint64_t fnv1a_bytes(const void* data, size_t size, uint64_t hash = kFnvOffsetBasis) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) {
    hash ^= bytes[i];
    hash *= kFnvPrime;
  }
  return hash;
}

inline uint64_t fnv1a(std::string_view text, uint64_t hash = kFnvOffsetBasis) {
  return fnv1a_bytes(text.data(), text.size(), hash);
}

/// Folds a 64-bit value in little-endian byte order, so equal values give equal digests on any platform.
inline uint64_t fnv1a_le(uint64_t value, uint64_t hash = kFnvOffsetBasis) {
  for (int byte = 0; byte < 8; ++byte) {
    hash ^= (value >> (8 * byte)) & 0xff;
    hash *= kFnvPrime;
  }
  return hash;
}

}  // namespace frag::ir
