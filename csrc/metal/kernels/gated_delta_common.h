// Shared by every gated-delta kernel: layouts, head mapping, the decay between
// two tokens of a chunk, and the 64 x 64 dot-product tile the chunked stages
// build on. Conservative MSL (no function constants, no swizzles).
#pragma once

#include <metal_stdlib>

#include "kernel_abi.h"

// Every kernel is instantiated for bfloat, which Metal has from language
// version 3.1: the version MLX compiles source libraries at on macOS 14, the
// oldest system it supports. Should MLX ever pass an older one, the build
// fails with this line quoted rather than with an unknown type.
#if defined(__METAL_VERSION__) && __METAL_VERSION__ < 310
#error "mlx-gated-delta's Metal kernels need Metal 3.1 (macOS 14 or newer) for bfloat"
#endif

using namespace metal;

// One host-named instantiation of a templated kernel (MLX's idiom). The first
// parameter must not be called `host_name`: the preprocessor would replace the
// attribute's own name with the string too.
#define instantiate_kernel(name, function, ...) \
  template [[host_name(name)]] [[kernel]] decltype(function<__VA_ARGS__>) function<__VA_ARGS__>;

inline uint key_head_of(constant GatedDeltaKernelParams& p, uint value_head) {
  return p.head_mapping == 0 ? value_head / p.value_heads_per_key_head
                             : value_head % p.key_heads;
}

// Offsets into the activations (row-major [B, T, H, D]) and gates ([B, T, Hv]).
inline uint qk_offset(constant GatedDeltaKernelParams& p, uint b, uint t, uint kh) {
  return ((b * p.tokens + t) * p.key_heads + kh) * p.key_dim;
}
inline uint v_offset(constant GatedDeltaKernelParams& p, uint b, uint t, uint h) {
  return ((b * p.tokens + t) * p.value_heads + h) * p.value_dim;
}
inline uint gate_offset(constant GatedDeltaKernelParams& p, uint b, uint t, uint h) {
  return (b * p.tokens + t) * p.value_heads + h;
}
// Per-key gates: g[b, t, h, c] of g [B, T, Hv, Dk], from gate_offset's value.
inline uint key_gate_offset(constant GatedDeltaKernelParams& p, uint gate, uint c) {
  return gate * p.key_dim + c;
}
inline bool token_is_masked(constant GatedDeltaKernelParams& p,
                            const device bool* mask, uint b, uint t) {
  return p.has_mask != 0 && !mask[b * p.tokens + t];
}

// The chunked stages' per-head scratch is laid out [B, H, num_chunks * 64, ...]:
// the first row of chunk c of head (b, h).
inline uint chunk_row(constant GatedDeltaKernelParams& p, uint b, uint h, uint heads,
                      uint chunk) {
  return ((b * heads + h) * p.num_chunks + chunk) * kChunkSize;
}
inline uint chunk_length(constant GatedDeltaKernelParams& p, uint chunk) {
  return min(kChunkSize, p.tokens - chunk * kChunkSize);
}

// Checkpoints (docs/contract.md): `checkpoints` holds N strictly increasing
// token counts; the state after checkpoints[n] tokens of the call goes to
// slot n of checkpoint_states [N, B, Hv, Dv, Dk].
inline uint checkpoint_offset(constant GatedDeltaKernelParams& p, uint n) {
  return n * p.batch * p.value_heads * p.value_dim * p.key_dim;
}
// Whether checkpoint `next` (if any is left) falls after `tokens` tokens.
inline bool checkpoint_at(constant GatedDeltaKernelParams& p, const device int* checkpoints,
                          uint next, uint tokens) {
  return next < p.num_checkpoints && uint(checkpoints[next]) == tokens;
}

// Tree verification: every token's state is kept in tree_states
// [B, Hv, T, Dv, Dk] for its children; this is the offset of token t's row
// `row` (the caller adds the column).
inline uint tree_state_row(constant GatedDeltaKernelParams& p, uint b, uint h, uint t,
                           uint row) {
  return (((b * p.value_heads + h) * p.tokens + t) * p.value_dim + row) * p.key_dim;
}

// Decay from token j to token i (j <= i) of one chunk: prod_{j < m <= i} exp(g_m).
// `gate_cumsum` sums only finite g inside the chunk and `last_wipe` is the last
// index <= i whose g is -inf (gamma == 0), or -1: a wipe in (j, i] gives
// exactly 0, and the difference of two cumsums is never formed across one, so
// no inf - inf NaN can arise.
inline float chunk_decay(const device float* gate_cumsum, const device int* last_wipe,
                         uint i, uint j) {
  return last_wipe[i] > int(j) ? 0.0f : exp(gate_cumsum[i] - gate_cumsum[j]);
}
// Decay from the chunk's entry state to token i (inclusive).
inline float decay_from_chunk_start(const device float* gate_cumsum,
                                    const device int* last_wipe, uint i) {
  return last_wipe[i] >= 0 ? 0.0f : exp(gate_cumsum[i]);
}

// Per-key gates: gate_cumsum and last_wipe keep one column per key channel,
// [B, Hv, C*64, Dk] (scalar gates: one, [B, Hv, C*64]).
inline uint gate_width(constant GatedDeltaKernelParams& p) {
  return p.per_key_gates != 0 ? p.key_dim : 1;
}
// The decay of key column c from token j to token i (j <= i) of one chunk, or
// from the chunk's entry state when j == -1; `cumsum` and `wipe` point at the
// chunk's first row. Scalar gates give chunk_decay() for every column. Per-key
// gates: exp(G_ic - G_jc), formed for the pair directly (its exponent is the
// sum of the channel's g over (j, i], never a positive number for decays),
// and exactly 0 when a wipe of channel c lies in (j, i], decided by position.
inline float channel_decay(constant GatedDeltaKernelParams& p, const device float* cumsum,
                           const device int* wipe, uint i, int j, uint c) {
  const uint width = gate_width(p);
  const uint column = p.per_key_gates != 0 ? c : 0;
  const uint at = i * width + column;
  if (wipe[at] > j) {
    return 0.0f;
  }
  return exp(cumsum[at] - (j >= 0 ? cumsum[uint(j) * width + column] : 0.0f));
}

// result[i * 64 + j] = a_i . b_j for the first `rows` rows of a 64-row chunk
// (rows past it give 0) over `dim` columns: the columns are staged through
// threadgroup tiles kTileWidth wide, and each of the 8 SIMD-groups multiplies
// its 8-row block by all 8 column blocks with 8 x 8 simdgroup matrices.
// Ends with a barrier: `result` is complete for every thread.
template <uint kTileWidth, typename T>
void chunk_dot_products(const device T* a_rows, const device T* b_rows, uint row_stride,
                        uint rows, uint dim, threadgroup float* a_tile,
                        threadgroup float* b_tile, threadgroup float* result, uint tid,
                        uint simd_index) {
  simdgroup_matrix<float, 8, 8> acc[kChunkSize / 8];
  for (uint n = 0; n < kChunkSize / 8; ++n) {
    acc[n] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  for (uint d0 = 0; d0 < dim; d0 += kTileWidth) {
    for (uint e = tid; e < kChunkSize * kTileWidth; e += kChunkThreads) {
      uint row = e / kTileWidth;
      uint column = d0 + e % kTileWidth;
      bool inside = row < rows && column < dim;
      a_tile[e] = inside ? float(a_rows[row * row_stride + column]) : 0.0f;
      b_tile[e] = inside ? float(b_rows[row * row_stride + column]) : 0.0f;
    }
    // The tiles are complete before any SIMD-group reads them.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint d = 0; d < kTileWidth; d += 8) {
      simdgroup_matrix<float, 8, 8> a;
      simdgroup_load(a, a_tile + simd_index * 8 * kTileWidth + d, kTileWidth);
      for (uint n = 0; n < kChunkSize / 8; ++n) {
        // Rows n*8.. of b, read transposed: the 8 x 8 block of b^T.
        simdgroup_matrix<float, 8, 8> b;
        simdgroup_load(b, b_tile + n * 8 * kTileWidth + d, kTileWidth, ulong2(0, 0), true);
        simdgroup_multiply_accumulate(acc[n], a, b, acc[n]);
      }
    }
    // Every SIMD-group is done reading before the next columns overwrite the tiles.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint n = 0; n < kChunkSize / 8; ++n) {
    simdgroup_store(acc[n], result + simd_index * 8 * kChunkSize + n * 8, kChunkSize);
  }
  // The result is complete before any thread reads it.
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Per-key gates: result[i * 64 + j] = sum_c a_ic b_jc decay(i, j, c) for
// j <= i < rows (0 elsewhere), the decay per channel as channel_decay() forms
// it. It cannot be applied after the product as one decay per head can, so
// each pair's factors are formed inside the sum. `tiles` stages four 64 x
// kKeyDecayTileWidth blocks of the columns at hand: a, b, the cumulative log
// decays and the last wipes (as floats: indices -1..63 are exact). Thread tid
// keeps the entries tid, tid + 256, ... in registers. Ends with a barrier:
// `result` is complete for every thread.
template <typename T>
void key_decayed_dot_products(const device T* a_rows, const device T* b_rows, uint row_stride,
                              uint rows, uint dim, const device float* cumsum,
                              const device int* wipe, threadgroup float* tiles,
                              threadgroup float* result, uint tid) {
  constexpr uint kWidth = kKeyDecayTileWidth;
  constexpr uint kBlock = kChunkSize * kWidth;
  constexpr uint kEntries = kChunkSize * kChunkSize / kChunkThreads;
  threadgroup float* a_tile = tiles;
  threadgroup float* b_tile = tiles + kBlock;
  threadgroup float* cumsum_tile = tiles + 2 * kBlock;
  threadgroup float* wipe_tile = tiles + 3 * kBlock;
  float acc[kEntries];
  for (uint n = 0; n < kEntries; ++n) {
    acc[n] = 0.0f;
  }
  for (uint d0 = 0; d0 < dim; d0 += kWidth) {
    for (uint e = tid; e < kBlock; e += kChunkThreads) {
      const uint row = e / kWidth;
      const uint column = d0 + e % kWidth;
      const bool inside = row < rows && column < dim;
      a_tile[e] = inside ? float(a_rows[row * row_stride + column]) : 0.0f;
      b_tile[e] = inside ? float(b_rows[row * row_stride + column]) : 0.0f;
      cumsum_tile[e] = inside ? cumsum[row * dim + column] : 0.0f;
      wipe_tile[e] = inside ? float(wipe[row * dim + column]) : -1.0f;
    }
    // The tiles are complete before any thread reads them.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint n = 0; n < kEntries; ++n) {
      const uint e = tid + n * kChunkThreads;
      const uint i = e / kChunkSize;
      const uint j = e % kChunkSize;
      if (j > i) {
        continue;
      }
      for (uint d = 0; d < kWidth; ++d) {
        const uint at_i = i * kWidth + d;
        const uint at_j = j * kWidth + d;
        const float decay =
            wipe_tile[at_i] > float(j) ? 0.0f : exp(cumsum_tile[at_i] - cumsum_tile[at_j]);
        acc[n] += a_tile[at_i] * decay * b_tile[at_j];
      }
    }
    // Every thread is done reading before the next columns overwrite the tiles.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint n = 0; n < kEntries; ++n) {
    result[tid + n * kChunkThreads] = acc[n];
  }
  // The result is complete before any thread reads it.
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
