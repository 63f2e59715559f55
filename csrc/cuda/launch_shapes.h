// The launch shapes of the CUDA kernels, shared by the kernels (.cu) and the
// executor that launches them (executor.cpp, executor_backward.cpp,
// launch.cpp).
#pragma once

#include "cuda/kernel_args.h"

// The helpers below are for the kernels (nvcc) and the executor alike.
#ifdef __CUDACC__
#define GD_HOST_DEVICE __host__ __device__
#else
#define GD_HOST_DEVICE
#endif

namespace mlx_gated_delta::cuda {

// recurrent: a block of kRecurrentWarps warps, each lane of a warp holding
// `columns` = ceil(Dk / 32) columns (Dk up to kRecurrentMaxKeyDim) of each of
// the warp's recurrent_rows_per_warp(columns) state rows: 8 rows up to
// Dk = 128, 4 above, at most 32 state values a lane.
constexpr int kRecurrentWarps = 4;
constexpr int kRecurrentThreads = 32 * kRecurrentWarps;
constexpr int kRecurrentMaxKeyDim = 256;
GD_HOST_DEVICE constexpr int recurrent_rows_per_warp(int columns) {
  return columns <= 4 ? 8 : 4;
}
GD_HOST_DEVICE constexpr int recurrent_rows_per_block(int columns) {
  return kRecurrentWarps * recurrent_rows_per_warp(columns);
}

// The chunked form's kernels (chunk_prepare, chunk_carry, chunk_output):
// 64-token chunks, 256 threads, key and value dims up to kChunkedMaxDim;
// chunk_carry keeps kCarryBlockRows rows of the state per block (below),
// chunk_output writes kOutputRows value columns of a chunk per block, and
// the backward's chunk_carry_backward keeps kCarryRows rows of dS per block
// (multiples of kTile below).
constexpr int kChunk = 64;
constexpr int kChunkedThreads = 256;
constexpr int kChunkedMaxDim = 128;
constexpr int kCarryRows = 16;
constexpr int kOutputRows = 64;
// The chunked backward's chunk_state_products: kStateSlices blocks a chunk,
// each whole column tiles of the key dim.
constexpr int kStateSlices = 2;

// Their products run on tensor cores in 16 x 16 tiles (tensor_core.cuh): the
// rows they keep in shared memory, and the W and U rows of their scratch, are
// padded with zeros to tile_padded(dim) columns; the shared rows' stride is
// tile_stride(dim), kTileSkew floats more, so that the rows of a tile start
// four banks apart and every tile starts 32-byte aligned (WMMA's loads).
constexpr int kTile = 16;
constexpr int kTileSkew = 4;
GD_HOST_DEVICE constexpr int tile_padded(int dim) {
  return (dim + kTile - 1) / kTile * kTile;
}
GD_HOST_DEVICE constexpr int tile_stride(int dim) {
  return tile_padded(dim) + kTileSkew;
}

// chunk_prepare with per-key gates keeps K's rows decayed relative to each
// row tile but the first, 16 rows for row tile 1, 32 for 2 and 48 for 3:
// kRelativeColumnRows (chunk_prepare.cu).
constexpr int kRelativeColumnRows = kChunk * (kChunk / kTile - 1) / 2;

// chunk_carry (chunk_carry.cu): kCarryBlockRows rows of the state a block,
// held in its warps' registers. Its shared memory is sized for Dk up to
// kChunkedMaxDim whatever the call's Dk, in floats: two stages of a chunk's
// inputs (W, K, U, the decays and the column decays; rows kCarryWStride,
// kCarryKStride and kCarryRowStride apart), the column groups' partial sums
// of W S^T (rows kCarryPartialStride apart) and the update's left operand.
constexpr int kCarryBlockRows = 32;
constexpr int kCarryColumnGroups = 4;
constexpr int kCarryWStride = kChunkedMaxDim + 8;
constexpr int kCarryKStride = kChunkedMaxDim + 4;
constexpr int kCarryRowStride = kCarryBlockRows + 4;
constexpr int kCarryPartialStride = kCarryBlockRows + 8;
constexpr int kCarryStageFloats = kChunk * kCarryWStride +
    kChunk * kCarryKStride + kChunk * kCarryRowStride + kDecayRows * kChunk +
    kChunkedMaxDim;
constexpr int kCarrySharedFloats = 2 * kCarryStageFloats +
    kCarryColumnGroups * kChunk * kCarryPartialStride +
    kChunk * kCarryRowStride;

// recurrent_backward: each (value head, batch row) spread over
// backward_row_blocks(Dv) blocks of kBackwardWarps warps, each warp
// kBackwardRowsPerWarp rows of the state (any value dim; key dims up to
// backward_max_key_dim, below); qk_grad_reduce: one warp per (batch row,
// token, key head), kReduceWarps to a block.
constexpr int kBackwardRowsPerWarp = 4;
constexpr int kBackwardWarps = 8;
constexpr int kBackwardThreads = 32 * kBackwardWarps;
constexpr int kBackwardRowsPerBlock = kBackwardRowsPerWarp * kBackwardWarps;
constexpr int kBackwardMaxDim = 256;
constexpr int kReduceWarps = 4;

// At least one block, so that a call with no value rows (Dv = 0) still writes
// its zero gradients of q and k.
GD_HOST_DEVICE constexpr int backward_row_blocks(int value_dim) {
  return value_dim > kBackwardRowsPerBlock
      ? (value_dim + kBackwardRowsPerBlock - 1) / kBackwardRowsPerBlock
      : 1;
}
// The floats of one token's sums of one row block (kernel_args.h's
// BackwardArgs::partials): dq, dk, da (per key with per-key gates), dbeta.
GD_HOST_DEVICE constexpr int backward_partial_width(int key_dim, bool per_key) {
  return 2 * key_dim + (per_key ? key_dim : 1) + 1;
}
// recurrent_backward's shared memory in floats (its Staged layout): a chunk
// of q, k (rows of whole warps of columns) and decays, beta, the mask, the
// block's rows of v and dy, and the warps' sums of two tokens.
GD_HOST_DEVICE constexpr int backward_shared_floats(int key_dim, bool per_key) {
  const int stride = (key_dim + 31) / 32 * 32;
  return kChunk * (2 * stride + (per_key ? stride : 1) + 2) +
      2 * kChunk * kBackwardRowsPerBlock +
      2 * kBackwardWarps * backward_partial_width(key_dim, per_key);
}
// The shared memory a block may opt into on sm_90, the architecture the build
// ships (csrc/cuda/cuda.cmake).
constexpr int kMaxSharedBytes = 227 * 1024;
// The largest key dim recurrent_backward takes: kBackwardMaxDim, or the
// largest multiple of 32 below it whose staged chunk fits kMaxSharedBytes
// (with per-key gates the decays take a row of Dk floats a token: 224).
constexpr int backward_max_key_dim(bool per_key) {
  int dk = kBackwardMaxDim;
  while (dk > 32 &&
         int(sizeof(float)) * backward_shared_floats(dk, per_key) >
             kMaxSharedBytes) {
    dk -= 32;
  }
  return dk;
}
static_assert(backward_max_key_dim(false) == 256);
static_assert(backward_max_key_dim(true) == 224);

// The segment's own stages (segment.cu): prepare_conv and
// collect_conv_state one thread per channel of a row, prepare_gates one per
// gate value, kSegmentThreads to a block; gated_norm one warp per (token,
// value head) row, kGatedNormWarps to a block.
constexpr int kSegmentThreads = 256;
constexpr int kGatedNormWarps = 8;

}  // namespace mlx_gated_delta::cuda
