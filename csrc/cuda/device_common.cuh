// Device helpers shared by the CUDA kernels (csrc/cuda/*.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/kernel_args.h"

namespace mlx_gated_delta::cuda {

constexpr int kWarp = 32;

__device__ inline float to_float(float x) {
  return x;
}
__device__ inline float to_float(__half x) {
  return __half2float(x);
}
__device__ inline float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ inline T from_float(float x);
template <>
__device__ inline float from_float<float>(float x) {
  return x;
}
template <>
__device__ inline __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// The sum over the warp, in every lane (a fixed butterfly order, so the same
// inputs always give the same bits).
__device__ inline float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

// The sums over the warp of kRows rows at once, x[i] a lane's share of row i:
// each butterfly step halves the rows a lane carries (it keeps one half and
// sends the other to its partner, which keeps that half), so the warp shuffles
// kRows - 1 + log2(32 / kRows) times instead of 5 kRows. Returns, in lane l,
// the sum of row l / (32 / kRows); x is spent. A fixed order, as warp_sum.
template <int kRows>
__device__ inline float warp_sum_rows(float (&x)[kRows]) {
  static_assert(
      kRows >= 1 && kRows <= kWarp && (kRows & (kRows - 1)) == 0,
      "a power of two rows, at most one a lane");
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int half = kRows / 2; half >= 1; half /= 2) {
    const int offset = kWarp / kRows * half;
    const bool upper = (lane & offset) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float keep = upper ? x[i + half] : x[i];
      const float send = upper ? x[i] : x[i + half];
      x[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
    }
  }
  float sum = x[0];
#pragma unroll
  for (int offset = kWarp / kRows / 2; offset > 0; offset /= 2) {
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  }
  return sum;
}

__device__ inline int key_head_of(const CoreArgs& a, int value_head) {
  return a.grouped ? value_head / (a.value_heads / a.key_heads)
                   : value_head % a.key_heads;
}

// The inverse L2 norm of normalize_qk (1 / sqrt(|x|^2 + 1e-6), as the CPU
// kernels and the reference).
__device__ inline float inverse_norm(float squared_norm) {
  return 1.0f / sqrtf(squared_norm + 1e-6f);
}

}  // namespace mlx_gated_delta::cuda
