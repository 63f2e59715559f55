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
