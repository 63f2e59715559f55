#include "metal/library.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "mlx/version.h"

#ifndef MLX_GATED_DELTA_VERSION
#error \
    "MLX_GATED_DELTA_VERSION must be defined by the build (the package version)"
#endif

namespace mlx_gated_delta::metal {

namespace {

// Enough of Metal's diagnostics to see the cause; the rest repeats it.
constexpr size_t kQuotedErrors = 8;

std::vector<std::string_view> lines_of(std::string_view text) {
  std::vector<std::string_view> lines;
  while (!text.empty()) {
    const size_t end = text.find('\n');
    lines.push_back(text.substr(0, end));
    text = end == std::string_view::npos ? std::string_view{}
                                         : text.substr(end + 1);
  }
  return lines;
}

}  // namespace

std::string library_source(const char* embedded) {
  const char* path = std::getenv(kTestSourceVariable);
  if (path == nullptr || *path == '\0')
    return embedded;
  std::ifstream file(path);
  if (!file) {
    throw std::runtime_error(
        std::string("the Metal library source is unavailable: ") +
        kTestSourceVariable + " names " + path + ", which cannot be read");
  }
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

std::string library_failure_message(std::string_view compiler_output) {
  // The first lines that carry "error:" (with the file and line the source's
  // #line markers give); if none does, the first lines as they come.
  std::vector<std::string_view> quoted;
  const std::vector<std::string_view> lines = lines_of(compiler_output);
  for (std::string_view line : lines) {
    if (line.find("error:") != std::string_view::npos &&
        quoted.size() < kQuotedErrors) {
      quoted.push_back(line);
    }
  }
  if (quoted.empty()) {
    quoted.assign(
        lines.begin(), lines.begin() + std::min(lines.size(), kQuotedErrors));
  }
  std::ostringstream message;
  message
      << "mlx_gated_delta: the Metal kernel library failed to build on this device, so "
         "the GPU kernels cannot run (mlx-gated-delta "
      << MLX_GATED_DELTA_VERSION << ", MLX " << mlx::core::version() << ").\n"
      << "The compiler's first errors:\n";
  for (std::string_view line : quoted)
    message << "    " << line << "\n";
  message
      << "This is a bug in mlx-gated-delta: please report it with this message and the "
         "output of `python -m mlx_gated_delta selftest`. Meanwhile, run the op on the "
         "CPU (stream=mx.cpu).";
  return message.str();
}

}  // namespace mlx_gated_delta::metal
