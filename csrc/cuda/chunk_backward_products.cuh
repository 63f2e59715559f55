// The [L, L] and [L, D] products of the chunked backward's per-chunk kernels
// (chunk_qk_backward.cu, chunk_wy_backward.cu), 256 threads a block, one
// 16 x 16 output tile per warp at a time, on tensor cores (tensor_core.cuh).
#pragma once

#include "cuda/chunked_common.cuh"

namespace mlx_gated_delta::cuda {

constexpr int kBackwardChunkWarps = kChunkedThreads / kWarp;
constexpr int kChunkTiles = kChunk / kTile;  // token tiles of a chunk
// The [kChunk, D] tiles a warp takes at most (D <= kChunkedMaxDim).
constexpr int kMaxRowTiles =
    kChunkTiles * (kChunkedMaxDim / kTile) / kBackwardChunkWarps;

// out = A B^T of two [L, width] row blocks (plus out's own values where
// kAccumulate), lower tiles only (tj <= ti; the others are stored as 0, or
// as they were where kAccumulate): warp w the tiles (w / 2, 2 (w % 2)) and
// (w / 2, 2 (w % 2) + 1), as the forward's k_gram.
template <bool kExactA, bool kExactB, bool kAccumulate = false>
__device__ void lower_gram(
    const float* a_rows,
    int a_stride,
    const float* b_rows,
    int b_stride,
    int width,
    float* out,
    int lp) {
  const int warp = threadIdx.x / kWarp;
  const int ti = warp / 2;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const int tj = 2 * (warp % 2) + n;
    float* at = out + ti * kTile * lp + tj * kTile;
    Product product;
    if constexpr (kAccumulate) {
      wmma::load_matrix_sync(product.sum, at, lp, wmma::mem_row_major);
    }
    if (tj <= ti) {
      for (int c0 = 0; c0 < width; c0 += 8) {
        product.add<wmma::row_major, wmma::col_major, kExactA, kExactB>(
            a_rows + ti * kTile * a_stride + c0, a_stride,
            b_rows + tj * kTile * b_stride + c0, b_stride);
      }
    }
    wmma::store_matrix_sync(at, product.finish(), lp, wmma::mem_row_major);
  }
}

// acc [L, width] (global, row stride width) += X B with X [L, L] in shared
// memory (X^T where kTransposed), B [L, width] rows; only the X entries of
// the lower triangle (upper for X^T) are read: row tile ti sums j < 16
// (ti + 1) (X^T: j >= 16 ti); kFull: every entry of X.
template <bool kTransposed, bool kExactB, bool kFull = false>
__device__ void accumulate_rows(
    float* acc,
    int width,
    const float* x,
    int lp,
    const float* b_rows,
    int b_stride) {
  const int warp = threadIdx.x / kWarp;
  const int tiles = kChunkTiles * (width / kTile);
#pragma unroll
  for (int n = 0; n < kMaxRowTiles; ++n) {
    const int tile = warp + n * kBackwardChunkWarps;
    if (tile < tiles) {
      const int ti = tile % kChunkTiles, tc = tile / kChunkTiles;
      float* at = acc + ti * kTile * width + tc * kTile;
      Product product;
      wmma::load_matrix_sync(product.sum, at, width, wmma::mem_row_major);
      const int j_begin = kTransposed && !kFull ? ti * kTile : 0;
      const int j_end = kTransposed || kFull ? kChunk : (ti + 1) * kTile;
      for (int j0 = j_begin; j0 < j_end; j0 += 8) {
        if constexpr (kTransposed) {
          product.add<wmma::col_major, wmma::row_major, false, kExactB>(
              x + j0 * lp + ti * kTile, lp, b_rows + j0 * b_stride + tc * kTile,
              b_stride);
        } else {
          product.add<wmma::row_major, wmma::row_major, false, kExactB>(
              x + ti * kTile * lp + j0, lp, b_rows + j0 * b_stride + tc * kTile,
              b_stride);
        }
      }
      wmma::store_matrix_sync(at, product.finish(), width, wmma::mem_row_major);
    }
  }
}

// T^T B for B [L, width] rows (T lower: row tile ti sums m >= 16 ti), into
// `out` (stride out_stride) once every warp has read B (the barrier inside,
// so that out may be B's buffer).
__device__ inline void inverse_transposed_times(
    const float* t,
    int lp,
    const float* b_rows,
    int b_stride,
    int width,
    float* out,
    int out_stride) {
  const int warp = threadIdx.x / kWarp;
  const int tiles = kChunkTiles * (width / kTile);
  Product products[kMaxRowTiles];
#pragma unroll
  for (int n = 0; n < kMaxRowTiles; ++n) {
    const int tile = warp + n * kBackwardChunkWarps;
    if (tile < tiles) {
      const int ti = tile % kChunkTiles, tc = tile / kChunkTiles;
      for (int m0 = ti * kTile; m0 < kChunk; m0 += 8) {
        products[n].add<wmma::col_major, wmma::row_major>(
            t + m0 * lp + ti * kTile, lp, b_rows + m0 * b_stride + tc * kTile,
            b_stride);
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int n = 0; n < kMaxRowTiles; ++n) {
    const int tile = warp + n * kBackwardChunkWarps;
    if (tile < tiles) {
      const int ti = tile % kChunkTiles, tc = tile / kChunkTiles;
      wmma::store_matrix_sync(
          out + ti * kTile * out_stride + tc * kTile, products[n].finish(),
          out_stride, wmma::mem_row_major);
    }
  }
}

// decay(i, j) for j <= i of chunk_prepare's gate_cumsum (0 past a wipe).
__device__ inline float chunk_decay(
    const float* log_sum, const float* last_wipe, int i, int j) {
  return last_wipe[i] > float(j) ? 0.0f : expf(log_sum[i] - log_sum[j]);
}

}  // namespace mlx_gated_delta::cuda
