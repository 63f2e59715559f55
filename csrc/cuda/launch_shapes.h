// The launch shapes of the CUDA kernels, shared by the kernels (.cu) and the
// executor that launches them (executor.cpp).
#pragma once

namespace mlx_gated_delta::cuda {

// recurrent: each warp owns kRowsPerWarp state rows, a block kRecurrentWarps
// warps; each lane holds ceil(Dk / 32) columns (up to kRecurrentMaxKeyDim).
constexpr int kRowsPerWarp = 4;
constexpr int kRecurrentWarps = 4;
constexpr int kRecurrentThreads = 32 * kRecurrentWarps;
constexpr int kRecurrentRowsPerBlock = kRowsPerWarp * kRecurrentWarps;
constexpr int kRecurrentMaxKeyDim = 256;

// The chunked form's kernels (chunk_prepare, chunk_carry, chunk_output):
// 64-token chunks, 256 threads, key and value dims up to kChunkedMaxDim;
// chunk_carry keeps kCarryRows rows of the state per block, chunk_output
// writes kOutputRows value columns of a chunk per block (both multiples of 8).
constexpr int kChunk = 64;
constexpr int kChunkedThreads = 256;
constexpr int kChunkedMaxDim = 128;
constexpr int kCarryRows = 16;
constexpr int kOutputRows = 32;

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
