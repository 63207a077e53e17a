//===- ir/error.h - Errors a user can act on ---------------------*- C++ -*-===//
//
// Every layer of fragments reports bad input (a file, a location, a rule, a
// rank that disagrees) with one exception type. The CLI prints its message on
// one line and exits non-zero; library users catch it. Internal invariants use
// TORCH_INTERNAL_ASSERT instead.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace frag {

/// `text` with control characters other than newline and tab written as \xNN: a NUL byte from a
/// file would otherwise end the message where what() is printed as a C string.
inline std::string printable(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (unsigned char c : text) {
    if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7f) out += fmt::format("\\x{:02x}", c);
    else out += static_cast<char>(c);
  }
  return out;
}

/// Bad input or a failed run, described so that a user can act on it.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(printable(message)) {}
};

/// Throws frag::Error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

/// `text` up to its first newline (all of it if it has none): the part of a
/// LibTorch, c10d or TorchScript message worth quoting in a one-line error,
/// without the backtrace or traceback that follows.
inline std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

}  // namespace frag
