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
//   column_decays [kChunkedMaxDim]: the chunk's decay of each state column
//   c, decay_c(L - 1, -1) (the same for every column with scalar gates; 0
//   past Dk), from chunk_prepare;
// chunk_output reads qk, decays, h and v'. Per (batch row, key head, chunk):
//   k [L, tile_padded(Dk)]: the chunk's K rows as the inputs give them (in
//   float32, 0 past the chunk's tokens; the scales are in `decays`), from
//   chunk_prepare: float16 and bfloat16 keys stay exact tensor-core operands
//   for chunk_carry's state update.
// With per-key gates (g [B, T, Hv, Dk]) the decays differ by key column, so
// nothing is shared by the value heads of a key head, and the columns'
// decays go with the rows, each value head's own: the scalar rows of
// `decays` hold 1 (decay(i, -1), decay(L - 1, j); the cumulative log decay 0
// and no wipe) beside the qk_norm scales, and per (batch row, value head,
// chunk)
//   k [L, tile_padded(Dk)]: k_jc decay_c(L - 1, j), K decayed to the
//   chunk's end, for chunk_carry's update,
//   q [L, tile_padded(Dk)]: q_ic decay_c(i, -1) / |q_i|, Q decayed from the
//   chunk's start with its qk_norm scale, for chunk_output's readout
//   (unused with scalar gates).
// The chunked backward's rerun of the forward also keeps, per (batch row,
// value head, chunk),
//   t [L, L]: kkt_inverse's T = (I + A)^-1, from chunk_prepare (nullptr in
//   the forward, which does not keep it),
//   k_from_start [L, tile_padded(Dk)], per-key gates only: k_jc
//   decay_c(j, -1), K decayed from the chunk's start as W takes it, for the
//   backward's dT and dbeta (nullptr otherwise).
constexpr int kDecayRows = 5;
struct ChunkScratch {
  float* w;
  float* u;
  float* qk;
  float* decays;
  float* h;
  float* k;
  float* column_decays;
  float* q;
  float* t;
  float* k_from_start;
};

// The chunked backward's own scratch (chunk_backward.cu,
// chunk_wy_backward.cu), float32, per (batch row, value head, chunk):
//   dv [L, tile_padded(Dv)]: chunk_output_backward's M^T dO, then
//   chunk_carry_backward's whole dV' (the exit state's share added),
//   ds [tile_padded(Dv), tile_padded(Dk)]: chunk_output_backward's G, the
//   entry state's share of dS, then chunk_carry_backward's cotangent of the
//   state at the chunk's end,
//   dq, dk [L, tile_padded(Dk)]: chunk_state_products' (dO S) and (V' dS),
//   then, scaled and with every other share added by chunk_qk_backward and
//   (dk) chunk_wy_backward, the gradients of the normalised q and k rows of
//   the value head,
//   dw [L, tile_padded(Dk)]: dW = -dV' S,
//   state_dots [kStateSlices]: <dS, S> of the chunk's entry state and exit
//   cotangent, a share per slice of chunk_state_products' key columns,
//   pairs [L, L]: chunk_qk_backward's share of each decay's gradient
//   without the decay, P_ij = dM_ij q_i . k_j (j < i, 0 elsewhere), which
//   chunk_wy_backward completes,
//   ends [2, L]: P_{i,-1} (the entry state's terms, chunk_qk_backward's
//   share) and P_{L-1,j} (the exit state's).
// With per-key gates the decays' gradients are per key channel and
// channel_pairs_backward takes every product with a decay in it
// (channel_pairs_backward.cu); these buffers then hold what it reads:
//   state_dots [tile_padded(Dk)]: <dS, S> per key column c, sum_r dS_rc S_rc,
//   dq, dk: dy S and V' dS as chunk_state_products wrote them (no scales),
//   dw: dW, then chunk_wy_backward's dKb = T^T dW, then
//   channel_pairs_backward's dbeta terms k_ic (dA K)_ic,
//   pairs [L, L]: dM = diag(s) dy V'^T on and below the diagonal,
//   da [L, L]: kkt_inverse_backward's dA, strictly lower (nullptr with
//   scalar gates); ends is not used.
struct ChunkBackwardScratch {
  float* dv;
  float* ds;
  float* dq;
  float* dk;
  float* dw;
  float* state_dots;
  float* pairs;
  float* ends;
  float* da;
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
//   dbeta), which qk_grad_reduce adds up; R = partial_blocks (the chunked
//   backward writes whole sums: R = 1).
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
  int partial_blocks;
};

// The fused segment's own stages (segment.cu), around the core's kernels;
// the layouts of segment/segment_params.h:
//   mixed [B, T, F] packed per token as [q | k | v | z | b | a]
//   conv_weight [C, K]   conv_state [B, K-1, C]   norm_weight [Dv]
//   decay_parameter [Hv]   dt_bias [Hv * gate_width]
//   out [B, T, Hv, Dv]   conv_checkpoint_states [N, B, K-1, C]
// and the float32 buffers between the stages and the core: q, k
// [B, T, Hk, Dk], v [B, T, Hv, Dv], g [B, T, Hv, gate_width], beta
// [B, T, Hv] (written by prepare_conv and prepare_gates), y [B, T, Hv, Dv]
// (the core's output, read by gated_norm). mixed, conv_state, out and the
// conv checkpoint states are in the activation dtype.
struct SegmentArgs {
  const void* mixed;
  const float* conv_weight;
  const float* decay_parameter;
  const float* dt_bias;
  const float* norm_weight;
  const void* conv_state_in;
  const bool* mask;  // nullptr: every token is kept
  const int* checkpoints;  // nullptr without checkpoints
  void* out;
  void* conv_state_out;
  void* conv_checkpoint_states;
  float* q;
  float* k;
  float* v;
  float* g;
  float* beta;
  const float* y;
  int batch;
  int tokens;
  int key_heads;
  int value_heads;
  int key_dim;
  int value_dim;
  int conv_kernel;  // K
  int conv_channels;  // C = 2 Hk Dk + Hv Dv
  int mixed_width;  // F
  int z_offset;
  int b_offset;
  int a_offset;
  int gate_width;  // a's values per value head: 1, or Dk per key channel
  int log_rate;  // 1: rate = -exp(decay_parameter); 0: the rate itself
  int has_lower_bound;
  float lower_bound;
  float beta_scale;  // 1, or 2 with allow_neg_eigval
  int sigmoid_output_gate;  // 0: silu(z)
  float norm_eps;
  int checkpoint_count;
};

}  // namespace mlx_gated_delta::cuda
