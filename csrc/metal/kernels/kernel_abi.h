// What the gated-delta kernels and the C++ plans must agree on: the scalar
// parameters every kernel receives (setBytes) and the layout constants that
// fix grids and threadgroup memory. Included verbatim by the .metal sources
// and by plain C++, so it uses only what both languages spell the same way.
#pragma once

#ifdef __METAL_VERSION__
#define GATED_DELTA_ABI_CONSTANT constant constexpr
#else
#define GATED_DELTA_ABI_CONSTANT constexpr
#endif

struct GatedDeltaKernelParams {
  unsigned int batch;
  unsigned int tokens;
  unsigned int key_heads;
  unsigned int value_heads;
  unsigned int key_dim;
  unsigned int value_dim;
  unsigned int value_heads_per_key_head;
  unsigned int head_mapping;  // 0: grouped (h / repeat), 1: interleaved (h % Hk)
  unsigned int normalize_qk;
  unsigned int has_mask;
  unsigned int num_chunks;
  float scale;
  unsigned int num_checkpoints;  // N: the states after checkpoints[n] tokens are kept
  unsigned int has_tree;  // 1: token t steps from token parents[t]'s state (recurrent only)
  unsigned int per_key_gates;  // 1: g is [B, T, Hv, Dk], a decay per key channel
  // The chunked backward's plan: chunk_states and recurrent_chunk_backward (the
  // recurrent reverse) run only the chunks the WY stages leave to them
  // (chunk_decays_normal in backward_common.h is false).
  unsigned int recurrent_wipe_chunks_only;
};

GATED_DELTA_ABI_CONSTANT unsigned int kChunkSize = 64;
// The chunked stages run 256 threads: 8 SIMD-groups, one per 8-row block of
// a 64 x 64 tile where they multiply with simdgroup matrices.
GATED_DELTA_ABI_CONSTANT unsigned int kChunkThreads = 256;
// Key columns staged per step when k_gram, chunk_qk and kkt_inverse build a
// 64 x 64 tile of dot products: two 64 x 16 tiles (8 KiB) beside the 16 KiB
// result keep those kernels at 24 KiB of threadgroup memory, within Metal's
// 32 KiB per threadgroup with room to spare.
GATED_DELTA_ABI_CONSTANT unsigned int kDotTileWidth = 16;
// Per-key gates: key columns staged per step when kkt_inverse and chunk_qk
// build a decayed 64 x 64 tile (key_decayed_grams). Three 64 x 8 tiles (k or
// q rows, k rows, the cumulative log decays) fit in the 8 KiB of the two
// dot-product tiles; so do the factored rows and columns of the sub-chunk
// products ((48 + 96) x 8).
GATED_DELTA_ABI_CONSTANT unsigned int kKeyDecayTileWidth = 8;
// Per-key gates: the rows of a sub-chunk of key_decayed_grams, whose decays
// are taken relative to its first row (as on the CPU).
GATED_DELTA_ABI_CONSTANT unsigned int kSubChunkSize = 16;
// qk_norm: one SIMD-group per (batch, token, key head) row.
GATED_DELTA_ABI_CONSTANT unsigned int kNormRowsPerThreadgroup = 8;
// gate_cumsum: one thread per (batch, value head, chunk), and per key
// channel with per-key gates.
GATED_DELTA_ABI_CONSTANT unsigned int kCumsumThreads = 64;
// chunk_carry: state rows one threadgroup keeps in threadgroup memory (64
// threads per row), and the widest key dimension those rows may have.
GATED_DELTA_ABI_CONSTANT unsigned int kCarryRows = 4;
GATED_DELTA_ABI_CONSTANT unsigned int kMaxChunkedKeyDim = 256;
// The recurrent kernels: value rows per SIMD threadgroup (one per
// SIMD-group), state entries per lane, and the generic kernel's rows per
// threadgroup (one per thread) and widest key dim (q, k in threadgroup memory).
GATED_DELTA_ABI_CONSTANT unsigned int kRecurrentSimdRows = 4;
GATED_DELTA_ABI_CONSTANT unsigned int kSimdStatePerLane = 4;
GATED_DELTA_ABI_CONSTANT unsigned int kRecurrentGenericRows = 64;
GATED_DELTA_ABI_CONSTANT unsigned int kMaxGenericKeyDim = 1024;

// The backward (docs/metal.md, backward). boundary_states and chunk_states:
// one SIMD-group per state row, kBackwardRows rows per threadgroup, each lane
// holding the key columns lane, lane + 32, ... of its row in registers.
// recurrent_chunk_backward: one threadgroup of kBackwardThreads per (batch, value head)
// over every state row (SIMD-group s takes rows s, s + 8, ...), so that the
// sums over rows (dq, dk, the gate gradients) stay inside it; its per-SIMD-
// group partial sums are kMaxBackwardKeyDim wide in threadgroup memory.
// qk_grad_reduce: one SIMD-group per (batch, token, key head) row.
GATED_DELTA_ABI_CONSTANT unsigned int kBackwardRows = 8;
GATED_DELTA_ABI_CONSTANT unsigned int kBackwardThreads = 256;
GATED_DELTA_ABI_CONSTANT unsigned int kBackwardSimdGroups = kBackwardThreads / 32;
GATED_DELTA_ABI_CONSTANT unsigned int kMaxBackwardKeyDim = 256;
GATED_DELTA_ABI_CONSTANT unsigned int kBackwardColumnsPerLane = kMaxBackwardKeyDim / 32;
GATED_DELTA_ABI_CONSTANT unsigned int kGradReduceRowsPerThreadgroup = 8;

// The fused layer segment's own stages (prepare_conv, prepare_gates,
// collect_conv_state, gated_norm) around the core's. One packed token row of
// `mixed` is [q | k | v | z | b | a]; the conv sees the C channels q|k|v.
struct SegmentKernelParams {
  unsigned int batch;
  unsigned int tokens;
  unsigned int key_heads;
  unsigned int value_heads;
  unsigned int key_dim;
  unsigned int value_dim;
  unsigned int conv_kernel;         // K taps; the conv state keeps K - 1 rows
  unsigned int conv_channels;       // C = 2 * Hk * Dk + Hv * Dv
  unsigned int mixed_qkvzba_width;  // F = C + Hv * Dv + Hv + Hv * gate_width
  unsigned int z_offset;
  unsigned int b_offset;
  unsigned int a_offset;
  unsigned int log_rate;  // 1: decay_parameter is A_log (rate = -exp(A_log)); 0: the rate
  unsigned int has_mask;
  float norm_eps;
  // The gate variants (segment/segment_params.h, SegmentGateOptions).
  unsigned int gate_width;  // a's and g's values per value head: 1, or Dk per key channel
  unsigned int has_lower_bound;  // 1: g = lower_bound * sigmoid(-rate * (a + dt_bias))
  float lower_bound;
  float beta_scale;  // beta = beta_scale * sigmoid(b): 1, or 2 with allow_neg_eigval
  unsigned int sigmoid_output_gate;  // 1: out = ... * sigmoid(z); 0: ... * silu(z)
};

// prepare_conv, prepare_gates, collect_conv_state: one thread per element,
// this many per threadgroup at most.
GATED_DELTA_ABI_CONSTANT unsigned int kSegmentThreads = 256;
// gated_norm: one SIMD-group per (batch, token, value head) row.
GATED_DELTA_ABI_CONSTANT unsigned int kGatedNormRowsPerThreadgroup = 8;
