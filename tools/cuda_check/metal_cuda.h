// The subset of MSL the gated-delta kernels use, mapped onto CUDA, so that
// NVRTC compiles the very .metal sources (after prep_cuda.py) for an NVIDIA
// GPU: threadgroup -> __shared__ (done by the rewrite), barriers ->
// __syncthreads, SIMD-group collectives -> warp shuffles (warp width 32 =
// Apple's SIMD width). Compiled with -default-device: every function not
// marked otherwise is a __device__ function.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef unsigned int uint;
typedef unsigned short ushort;
typedef __half half;
typedef __nv_bfloat16 bfloat;

#define kernel
#define device
#define constant const
#define thread
#define threadgroup

namespace metal {}

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };

__device__ inline void threadgroup_barrier(mem_flags) {
  __syncthreads();
}

__device__ inline float simd_sum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

template <typename T>
__device__ inline T simd_shuffle(T value, ushort lane) {
  return __shfl_sync(0xffffffffu, value, lane);
}

// What the generated __global__ wrappers pass for [[buffer(n)]] arguments.
struct BufferPointer {
  void* address;
  template <typename T>
  __device__ operator T*() const {
    return static_cast<T*>(address);
  }
};
struct BufferReference {
  void* address;
  template <typename T>
  __device__ operator T&() const {
    return *static_cast<T*>(address);
  }
};
