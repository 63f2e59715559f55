// The arguments of the CUDA kernels: plain structs that the kernels (.cu,
// compiled by nvcc) and the executor (.cpp, compiled by the host compiler
// against MLX's CUDA backend headers) both read. Each kernel takes one of
// them by value, so a launch passes a single parameter.
#pragma once

#include <cstdint>

namespace mlx_gated_delta::cuda {

// The activation dtype of q, k, v and y.
enum class Activation : int { Float32 = 0, Float16 = 1, BFloat16 = 2 };

// The layouts of docs/contract.md, all row-contiguous:
//   q, k [B, T, Hk, Dk]   v, y [B, T, Hv, Dv]   g [B, T, Hv (, Dk)]
//   beta [B, T, Hv]   mask [B, T]   state [B, Hv, Dv, Dk]
//   checkpoints [N]   checkpoint_states [N, B, Hv, Dv, Dk]   parents [T]
struct CoreArgs {
  const void* q;
  const void* k;
  const void* v;
  const float* g;
  const float* beta;
  const bool* mask;  // nullptr: every token is active
  const float* state_in;
  void* y;
  float* state_out;
  const int* checkpoints;  // nullptr without checkpoints
  float* checkpoint_states;
  // Tree verification: token t steps from token parents[t]'s state (-1: the
  // initial state); every token's state is kept in tree_states
  // [B, Hv, T, Dv, Dk] (scratch). nullptr without a tree.
  const int* parents;
  float* tree_states;
  int batch;
  int tokens;
  int key_heads;
  int value_heads;
  int key_dim;
  int value_dim;
  float scale;
  int grouped;  // 1: kh = h / (Hv / Hk); 0: kh = h % Hk
  int normalize_qk;
  int per_key_gates;
  int checkpoint_count;
};

// The chunked form's scratch (docs/stages.md), float32, per (batch row,
// value head, chunk):
//   w [L, tile_padded(Dk)] and u [L, tile_padded(Dv)] of the WY form
//   (launch_shapes.h; the padding columns are 0), from chunk_prepare;
//   chunk_carry overwrites u with v' = U - W S^T,
//   qk [L, L]: decay(i, j) q_i . k_j for j <= i, 0 above, from chunk_prepare,
//   decays [kDecayRows, L]: decay(i, -1), decay(L - 1, j), the cumulative
//   log decay and the last wipe (as a float) of gate_cumsum, and k_j's
//   qk_norm scale (1 / |k_j|, else 1; 0 past the chunk's tokens), likewise,
//   h [Dv, Dk]: the state at the chunk's start, from chunk_carry;
// chunk_output reads qk, decays, h and v'. Per (batch row, key head, chunk):
//   k [L, tile_padded(Dk)]: the chunk's K rows as the inputs give them (in
//   float32, 0 past the chunk's tokens; the scales are in `decays`), from
//   chunk_prepare: float16 and bfloat16 keys stay exact tensor-core operands
//   for chunk_carry's state update.
constexpr int kDecayRows = 5;
struct ChunkScratch {
  float* w;
  float* u;
  float* qk;
  float* decays;
  float* h;
  float* k;
};

// The backward's buffers beside CoreArgs (which gives q, k, v, g, beta, mask,
// the initial state and the dims): the cotangents, the gradients in the
// layouts of their inputs, and the scratch of recurrent_backward.cu, float32,
// with R = backward_row_blocks(Dv) blocks of kBackwardRowsPerBlock rows per
// head and P = kColumns * 32 (Dk rounded up to whole warps):
//   boundaries [B, Hv, R, chunks, kBackwardRowsPerBlock, P]: the state
//   entering each chunk,
//   chunk_states [B, Hv, R, kChunk, kBackwardRowsPerBlock, P]: the state
//   before each token of the chunk being reversed,
//   partials [B, T, Hv, R, backward_partial_width(Dk)]: each row block's
//   share of the sums over rows (dq, dk of the normalised q and k, da,
//   dbeta), which qk_grad_reduce adds up.
struct BackwardArgs {
  const void* dy;
  const float* state_cotangent;
  void* dq;
  void* dk;
  void* dv;
  float* dg;
  float* dgamma;
  float* dbeta;
  float* dstate;
  float* boundaries;
  float* chunk_states;
  float* partials;
};

}  // namespace mlx_gated_delta::cuda
