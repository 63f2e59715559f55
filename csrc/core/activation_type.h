// The activation dtypes (float32, float16, bfloat16) as the C++ types the CPU
// kernels are instantiated for: the one switch over them that every kernel
// entry point takes.
#pragma once

#include <stdexcept>
#include <string>

#include "mlx/array.h"

namespace mlx_gated_delta {

// run(T{}) with T the C++ type of `dtype`, returning what run returns. Throws
// std::runtime_error naming `who` for any other dtype (the op functions have
// refused those already).
template <typename Run>
decltype(auto) with_activation_type(
    mlx::core::Dtype dtype, const char* who, Run&& run) {
  switch (dtype) {
    case mlx::core::float32:
      return run(float{});
    case mlx::core::float16:
      return run(mlx::core::float16_t{});
    case mlx::core::bfloat16:
      return run(mlx::core::bfloat16_t{});
    default:
      throw std::runtime_error(
          std::string(who) + ": unsupported activation dtype");
  }
}

}  // namespace mlx_gated_delta
