// What the chunked form's three kernels share (chunk_prepare.cu,
// chunk_carry.cu, chunk_output.cu): the chunked WY form on CUDA
// (docs/stages.md), scalar gates, in three kernels:
//
//   chunk_prepare  one block per (chunk, value head, batch row), all chunks at
//                  once: qk_norm, gate_cumsum, k_gram, chunk_qk, kkt_inverse
//                  and recompute_w_u of one chunk, writing W, U, the decayed
//                  Q K^T, the chunk's decays and its K to scratch
//                  (ChunkScratch).
//   chunk_carry    one block per (kCarryBlockRows state rows, value head,
//                  batch row), the chunks in order: v' = U - W S^T, the
//                  checkpoints and the next state (chunk_carry_state); it
//                  writes v' and each chunk's starting state to scratch.
//   chunk_output   one block per (chunk, kOutputRows value columns, value
//                  head, batch row), all chunks at once: the inter-chunk
//                  readout S q_i plus the decayed Q K^T times v'.
//
// The sequential pass does only what the next chunk depends on; the output,
// which nothing later reads, leaves the chain.
//
// Everything is float32. The matrix products run on tensor cores in 3xTF32
// (tensor_core.cuh): chunk_prepare's and chunk_output's through WMMA from
// shared memory, in rows of tile_stride floats (launch_shapes.h), one 16 x 16
// output tile per warp at a time; chunk_carry's as PTX's m16n8k8 products on
// the state it keeps in registers. Gates, decays and kkt_inverse's diagonal
// blocks are float32 FMA. Q, K and V stay
// as the inputs give them, their qk_norm scales applied to the products'
// other operands or results, so that float16 and bfloat16 values are exact
// operands (kExactInTf32), which need one or two tensor-core products a
// step instead of three.
#pragma once

#include <cuda_pipeline.h>

#include <type_traits>

#include "cuda/device_common.cuh"
#include "cuda/launch_shapes.h"
#include "cuda/tensor_core.cuh"

namespace mlx_gated_delta::cuda {

// Whether an activation dtype's values are exact tensor-core operands as
// float32 (tensor_core.cuh's Product): float16's and bfloat16's are.
template <typename T>
constexpr bool kExactInTf32 = !std::is_same_v<T, float>;

// One chunk's rows [0, kChunk) of a [T, heads, dim] activation (token t's
// row at source + t * token_stride), in registers: warp w holds rows
// [kRowsPerWarp w, kRowsPerWarp (w + 1)), lane the columns lane + 32 j
// (dim <= kChunkedMaxDim), 0 past the chunk's `length` tokens. fetch issues
// every load before any is used (their latency, not their bytes, bounds this
// step), so a kernel can fetch early and store once the shared rows are free.
constexpr int kColumnsPerLane = kChunkedMaxDim / kWarp;

struct ChunkRows {
  static constexpr int kRowsPerWarp = kChunk * kWarp / kChunkedThreads;
  float x[kRowsPerWarp][kColumnsPerLane];

  template <typename T>
  __device__ void fetch(
      const T* source, int64_t token_stride, int dim, int length) {
    const int lane = threadIdx.x % kWarp;
    const int i0 = threadIdx.x / kWarp * kRowsPerWarp;
#pragma unroll
    for (int n = 0; n < kRowsPerWarp; ++n) {
#pragma unroll
      for (int j = 0; j < kColumnsPerLane; ++j) {
        const int c = lane + kWarp * j;
        x[n][j] = (i0 + n < length && c < dim)
            ? to_float(source[(i0 + n) * token_stride + c])
            : 0.0f;
      }
    }
  }

  // Each row's scale into row_scales[i]: 1 / |x_i| with `normalize`
  // (qk_norm), else 1, and 0 past the chunk's tokens.
  __device__ void store_scales(
      int length, bool normalize, float* row_scales) const {
    const int lane = threadIdx.x % kWarp;
    const int i0 = threadIdx.x / kWarp * kRowsPerWarp;
#pragma unroll
    for (int n = 0; n < kRowsPerWarp; ++n) {
      float scale = 1.0f;
      if (normalize) {
        float squares = 0.0f;
#pragma unroll
        for (int j = 0; j < kColumnsPerLane; ++j) {
          squares += x[n][j] * x[n][j];
        }
        scale = inverse_norm(warp_sum(squares));
      }
      if (lane == 0) {
        row_scales[i0 + n] = i0 + n < length ? scale : 0.0f;
      }
    }
  }

  // Into shared rows of stride `stride`, columns [0, tile_padded(dim)), as
  // they are (so that float16 and bfloat16 rows stay exact tensor-core
  // operands, kExactInTf32), and, where row_scales is not null, each row's
  // scale (store_scales). The kernels apply the scales to the products.
  __device__ void store(
      int dim, int length, bool normalize, float* row_scales, float* rows,
      int stride) const {
    if (row_scales != nullptr) {
      store_scales(length, normalize, row_scales);
    }
    const int lane = threadIdx.x % kWarp;
    const int i0 = threadIdx.x / kWarp * kRowsPerWarp;
    const int width = tile_padded(dim);
#pragma unroll
    for (int n = 0; n < kRowsPerWarp; ++n) {
#pragma unroll
      for (int j = 0; j < kColumnsPerLane; ++j) {
        const int c = lane + kWarp * j;
        if (c < width) {
          rows[(i0 + n) * stride + c] = x[n][j];
        }
      }
    }
  }
};

template <typename T>
__device__ inline void load_rows(
    const T* source,
    int64_t token_stride,
    int dim,
    int length,
    bool normalize,
    float* row_scales,
    float* rows,
    int stride) {
  ChunkRows chunk_rows;
  chunk_rows.fetch(source, token_stride, dim, length);
  chunk_rows.store(dim, length, normalize, row_scales, rows, stride);
}

// Where a block's chunk lies: batch row, value head, its first token and
// length, and its index into the per-chunk scratch.
struct ChunkPlace {
  int b, h, chunk, t0, length;
  int64_t index;  // (b * Hv + h) * chunks + chunk
};

// A chunk's Q rows into shared rows of stride `stride` and their scales into
// query_scales, for chunk_output and chunk_output_backward: with per-key
// gates chunk_prepare's Q (ChunkScratch::q: scaled, decayed from the chunk's
// start), whose scales are 1; else the input's rows as they are, with their
// qk_norm scales. Past the chunk's tokens rows and scales are 0.
template <typename T>
__device__ inline void load_chunk_queries(
    const CoreArgs& a,
    const ChunkScratch& s,
    const ChunkPlace& place,
    float* query_scales,
    float* rows,
    int stride) {
  const int dk = a.key_dim;
  if (a.per_key_gates != 0) {
    const int kw = tile_padded(dk);
    load_rows(
        s.q + place.index * kChunk * kw,
        kw,
        dk,
        place.length,
        false,
        query_scales,
        rows,
        stride);
  } else {
    const int64_t bt0 = int64_t(place.b) * a.tokens + place.t0;
    load_rows(
        static_cast<const T*>(a.q) +
            (bt0 * a.key_heads + key_head_of(a, place.h)) * dk,
        int64_t(a.key_heads) * dk,
        dk,
        place.length,
        a.normalize_qk != 0,
        query_scales,
        rows,
        stride);
  }
}

// Asynchronous copies of float32 scratch into shared memory (cp.async
// through CUDA's pipeline primitives): rows [0, rows) of `width` columns of a
// row-major block (row stride `source_stride`) into shared rows of stride
// `stride` (a multiple of 4, 16-byte aligned); warp w the rows w, w + 8, ...,
// each lane 4 floats at a time where the rows allow 16-byte copies, else
// single floats. The copies land once the thread has waited for them
// (__pipeline_wait_prior) and the block has passed a barrier.
__device__ inline void copy_rows_async(
    const float* source,
    int64_t source_stride,
    int rows,
    int width,
    float* shared_rows,
    int stride) {
  const int lane = threadIdx.x % kWarp;
  const bool vectors = width % 4 == 0 && source_stride % 4 == 0 &&
      reinterpret_cast<uintptr_t>(source) % 16 == 0;
  const int step = vectors ? 4 : 1;
  for (int r = threadIdx.x / kWarp; r < rows; r += kChunkedThreads / kWarp) {
    for (int c = step * lane; c < width; c += step * kWarp) {
      __pipeline_memcpy_async(
          shared_rows + r * stride + c,
          source + r * source_stride + c,
          sizeof(float) * step);
    }
  }
}

__device__ inline ChunkPlace chunk_place(const CoreArgs& a, int chunk) {
  ChunkPlace place;
  place.b = blockIdx.z;
  place.h = blockIdx.y;
  place.chunk = chunk;
  place.t0 = chunk * kChunk;
  place.length = min(kChunk, a.tokens - place.t0);
  const int chunks = (a.tokens + kChunk - 1) / kChunk;
  place.index = (int64_t(place.b) * a.value_heads + place.h) * chunks + chunk;
  return place;
}

}  // namespace mlx_gated_delta::cuda
