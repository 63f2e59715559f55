// a * b + c for the CPU kernels' inner loops. The build forbids the compiler
// to fuse multiplies and adds on its own (-ffp-contract=off, see
// CMakeLists.txt), so every fusion is written here, and every version of a
// loop the compiler makes (vectorised, scalar, peeled) rounds alike.
#pragma once

#include <cmath>

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

inline float multiply_add(float a, float b, float c) {
#if defined(__FMA__) || defined(__aarch64__)
  return std::fma(a, b, c);  // one instruction, one rounding
#else
  return a * b + c;  // std::fma would be a slow library call here
#endif
}

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
