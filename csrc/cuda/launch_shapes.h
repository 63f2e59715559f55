// The launch shapes of the CUDA kernels, shared by the kernels (.cu) and the
// executor that launches them (executor.cpp).
#pragma once

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
// chunk_carry keeps kCarryRows rows of the state per block, chunk_output
// writes kOutputRows value columns of a chunk per block (both multiples of
// kTile below).
constexpr int kChunk = 64;
constexpr int kChunkedThreads = 256;
constexpr int kChunkedMaxDim = 128;
constexpr int kCarryRows = 16;
constexpr int kOutputRows = 64;

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

// recurrent_backward: one block per (value head, batch row) holds the whole
// state, kBackwardWarps warps of kBackwardRowsPerWarp rows (value dims up to
// kBackwardMaxDim, key dims likewise); qk_grad_reduce: one warp per (batch
// row, token, key head), kReduceWarps to a block.
constexpr int kBackwardRowsPerWarp = 8;
constexpr int kBackwardWarps = 16;
constexpr int kBackwardThreads = 32 * kBackwardWarps;
constexpr int kBackwardMaxDim = kBackwardRowsPerWarp * kBackwardWarps;
constexpr int kReduceWarps = 4;

}  // namespace mlx_gated_delta::cuda
