// MLX's CUDA backend headers include <fmt/format.h> for the text of a few
// error messages in inline code; the MLX wheel does not ship the fmt library.
// This header gives those messages the one function they call, fmt::format
// with "{}" placeholders, so that the headers compile without fmt installed.
// Only the executor (csrc/cuda/*.cpp) sees it.
#pragma once

#include <sstream>
#include <string>
#include <string_view>

namespace fmt {

namespace detail {

inline void append_format(std::ostringstream& out, std::string_view text) {
  out << text;
}

template <typename First, typename... Rest>
void append_format(
    std::ostringstream& out,
    std::string_view text,
    const First& first,
    const Rest&... rest) {
  const size_t at = text.find("{}");
  if (at == std::string_view::npos) {
    out << text;
    return;
  }
  out << text.substr(0, at) << first;
  append_format(out, text.substr(at + 2), rest...);
}

}  // namespace detail

template <typename... Args>
std::string format(std::string_view text, const Args&... args) {
  std::ostringstream out;
  detail::append_format(out, text, args...);
  return out.str();
}

}  // namespace fmt
