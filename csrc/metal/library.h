// The Metal kernel library as MLX's Device::get_library compiles it at run
// time, and the error a user reads when that compile fails. Plain C++, built
// on every platform so that the message is tested where there is no Apple GPU.
#pragma once

#include <string>
#include <string_view>

namespace mlx_gated_delta::metal {

// Names a file whose text replaces the embedded library source: a test hook
// that makes the source invalid (or, if the file is missing, unavailable) so
// that the failure path can be exercised on a Mac. Not for normal use.
inline constexpr const char* kTestSourceVariable =
    "MLX_GATED_DELTA_TEST_METAL_SOURCE";

// `embedded` unless the test hook is set; throws std::runtime_error when the
// hook names a file that cannot be read.
std::string library_source(const char* embedded);

// The error raised on the first GPU call when the library does not build:
// quotes the compiler's first errors from `compiler_output` (the text of the
// exception MLX throws), names this package's and MLX's versions and asks for
// a report with `python -m mlx_gated_delta selftest`'s output.
std::string library_failure_message(std::string_view compiler_output);

}  // namespace mlx_gated_delta::metal
