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
typedef unsigned long ulong;
typedef __half half;
typedef __nv_bfloat16 bfloat;

#define kernel
#define device
#define constant const
#define thread
#define threadgroup

namespace metal {}

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };

// Both flags at once (a barrier over device and threadgroup memory): the
// flags only pick what the barrier orders, and __syncthreads orders both.
__device__ inline mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<int>(a) | static_cast<int>(b));
}

// __syncthreads: every thread of the block waits, and its shared and global
// memory writes before it are visible to the block's threads after it.
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

// MSL's ulong2 is constructed as ulong2(x, y); CUDA's own is an aggregate.
#define ulong2 metal_ulong2
struct metal_ulong2 {
  ulong x, y;
  __device__ metal_ulong2(ulong x_, ulong y_) : x(x_), y(y_) {}
};

// simdgroup_matrix as a warp-wide value: each lane holds the whole matrix
// (redundant work, exact semantics); a store writes each element from one
// lane, as on the GPU. Element (r, c) is source[r * stride + c], or
// source[c * stride + r] when transposed; matrix_origin is always 0 here.
template <typename T, int Rows, int Cols>
struct simdgroup_matrix {
  T elements[Rows * Cols];
};
template <typename T, int Rows, int Cols>
__device__ simdgroup_matrix<T, Rows, Cols> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Rows, Cols> matrix;
  for (int e = 0; e < Rows * Cols; ++e) matrix.elements[e] = value;
  return matrix;
}
template <typename T, int Rows, int Cols>
__device__ void simdgroup_load(simdgroup_matrix<T, Rows, Cols>& matrix, const T* source,
                               ulong stride = Cols, ulong2 = ulong2(0, 0), bool transpose = false) {
  for (int r = 0; r < Rows; ++r) {
    for (int c = 0; c < Cols; ++c) {
      matrix.elements[r * Cols + c] = transpose ? source[c * stride + r] : source[r * stride + c];
    }
  }
}
template <typename T, int N>
__device__ void simdgroup_multiply_accumulate(simdgroup_matrix<T, N, N>& d,
                                              const simdgroup_matrix<T, N, N>& a,
                                              const simdgroup_matrix<T, N, N>& b,
                                              const simdgroup_matrix<T, N, N>& c) {
  simdgroup_matrix<T, N, N> result;
  for (int r = 0; r < N; ++r) {
    for (int col = 0; col < N; ++col) {
      T sum = c.elements[r * N + col];
      for (int k = 0; k < N; ++k) sum += a.elements[r * N + k] * b.elements[k * N + col];
      result.elements[r * N + col] = sum;
    }
  }
  d = result;
}
template <typename T, int Rows, int Cols>
__device__ void simdgroup_store(const simdgroup_matrix<T, Rows, Cols>& matrix, T* destination,
                                ulong stride = Cols, ulong2 = ulong2(0, 0), bool transpose = false) {
  const unsigned lane = threadIdx.x % 32u;
  for (unsigned e = lane; e < unsigned(Rows * Cols); e += 32u) {
    const unsigned r = e / Cols, c = e % Cols;
    (transpose ? destination[c * stride + r] : destination[r * stride + c]) = matrix.elements[e];
  }
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
