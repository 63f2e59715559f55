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
// A decay below this is tiny: the chunked backward leaves its chunk to the
// recurrent reverse (gate_cumsum records it, chunk_decays_normal reads it).
GATED_DELTA_ABI_CONSTANT float kSmallestNormalFloat = 1.17549435e-38f;
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

// Whether a wipe lies in steps (j, i] of a chunk (none when j >= i; j == -1:
// from the chunk's entry state), from the chunk's wipe mask, whose bit m is
// set when step m's decay is 0 (gate_cumsum).
inline bool wiped_between(ulong wipe_mask, int j, uint i) {
  const ulong through_i = i >= kChunkSize - 1 ? ~0ul : (1ul << (i + 1)) - 1ul;
  const ulong through_j =
      j < 0 ? 0ul : (uint(j) >= kChunkSize - 1 ? ~0ul : (1ul << (uint(j) + 1)) - 1ul);
  return (wipe_mask & through_i & ~through_j) != 0ul;
}

// Decay from token j to token i (j <= i) of one chunk: prod_{j < m <= i} exp(g_m).
// `gate_cumsum` sums only finite g inside the chunk and `wipe_mask` (the
// chunk's) marks the steps whose decay is 0 (gamma == 0): a wipe in (j, i]
// gives exactly 0, and the difference of two cumsums is never formed across
// one, so no inf - inf NaN can arise.
inline float chunk_decay(const device float* gate_cumsum, const device ulong* wipe_mask,
                         uint i, uint j) {
  return wiped_between(wipe_mask[0], int(j), i) ? 0.0f : exp(gate_cumsum[i] - gate_cumsum[j]);
}
// Decay from the chunk's entry state to token i (inclusive).
inline float decay_from_chunk_start(const device float* gate_cumsum,
                                    const device ulong* wipe_mask, uint i) {
  return wiped_between(wipe_mask[0], -1, i) ? 0.0f : exp(gate_cumsum[i]);
}

// Per-key gates: gate_cumsum keeps one column per key channel, [B, Hv, C*64,
// Dk], and there is one wipe mask per chunk and key channel, [B, Hv, C, Dk]
// (scalar gates: one, [B, Hv, C*64] and [B, Hv, C]).
inline uint gate_width(constant GatedDeltaKernelParams& p) {
  return p.per_key_gates != 0 ? p.key_dim : 1;
}
// The decay of key column c from token j to token i (j <= i) of one chunk, or
// from the chunk's entry state when j == -1; `cumsum` points at the chunk's
// first row and `wipe_mask` at its masks. Scalar gates give chunk_decay() for
// every column. Per-key gates: exp(G_ic - G_jc), formed for the pair directly
// (its exponent is the sum of the channel's g over (j, i], never a positive
// number for decays), and exactly 0 when a wipe of channel c lies in (j, i].
inline float channel_decay(constant GatedDeltaKernelParams& p, const device float* cumsum,
                           const device ulong* wipe_mask, uint i, int j, uint c) {
  const uint width = gate_width(p);
  const uint column = p.per_key_gates != 0 ? c : 0;
  if (wiped_between(wipe_mask[column], j, i)) {
    return 0.0f;
  }
  const uint at = i * width + column;
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

// Per-key gates, the stage key_decayed_grams: result[i * 64 + j] =
// sum_c a_ic b_jc decay(i, j, c) for j <= i < rows (0 elsewhere), in
// sub-chunks of kSubChunkSize rows as the CPU forms it (docs/numerics.md,
// "Per-key-channel gates in the chunked form"). A decay per channel cannot be
// applied after the product as one decay per head can; with p the first row
// of the sub-chunk that holds row i:
//
// - j < p (left of the sub-chunk): decay(i, j, c) = decay(i, p, c) decay(p,
//   j, c), two factors whose exponents are sums of g over (p, i] and (j, p],
//   so both are at most 1 at any gate strength (factoring from the chunk's
//   start instead forms exp(-G_j), inf for a strong channel), and a wipe in
//   (j, i] lies in one of the two intervals and zeroes that factor. These
//   entries are the product of the rows a_ic decay(i, p, c) and the columns
//   b_jc decay(p, j, c): each SIMD-group multiplies its 8-row block by the
//   8-column blocks left of its sub-chunk with 8 x 8 simdgroup matrices.
// - p <= j <= i (the diagonal blocks): pair by pair in float32, each pair's
//   decay exp(G_ic - G_jc) as channel_decay() forms it. (A bound on g would
//   allow a product here too; nothing in the params carries one.)
//
// `tiles` stages the columns at hand, kKeyDecayTileWidth at a time: for the
// pairs, three 64-row blocks (a, b and the cumulative log decays; each thread
// keeps the columns' wipe masks in registers); for the products, the factored
// rows of sub-chunks 1..3 and each sub-chunk's factored columns. Thread tid
// keeps the diagonal entries tid, tid + 256, ... in registers. Ends with a
// barrier: `result` is complete for every thread.
template <typename T>
void key_decayed_grams(const device T* a_rows, const device T* b_rows, uint row_stride,
                       uint rows, uint dim, const device float* cumsum,
                       const device ulong* wipe_mask, threadgroup float* tiles,
                       threadgroup float* result, uint tid, uint simd_index) {
  constexpr uint kWidth = kKeyDecayTileWidth;
  constexpr uint kSub = kSubChunkSize;
  constexpr uint kSubChunks = kChunkSize / kSub;
  constexpr uint kBlock = kChunkSize * kWidth;
  constexpr uint kEntries = kSubChunks * kSub * kSub / kChunkThreads;

  // The diagonal blocks, pair by pair. Entry e is row e / kSub % kSub and
  // column e % kSub of sub-chunk e / kSub^2.
  threadgroup float* a_tile = tiles;
  threadgroup float* b_tile = tiles + kBlock;
  threadgroup float* cumsum_tile = tiles + 2 * kBlock;
  float diagonal[kEntries];
  for (uint n = 0; n < kEntries; ++n) {
    diagonal[n] = 0.0f;
  }
  for (uint d0 = 0; d0 < dim; d0 += kWidth) {
    for (uint e = tid; e < kBlock; e += kChunkThreads) {
      const uint row = e / kWidth;
      const uint column = d0 + e % kWidth;
      const bool inside = row < rows && column < dim;
      a_tile[e] = inside ? float(a_rows[row * row_stride + column]) : 0.0f;
      b_tile[e] = inside ? float(b_rows[row * row_stride + column]) : 0.0f;
      cumsum_tile[e] = inside ? cumsum[row * dim + column] : 0.0f;
    }
    ulong column_wipes[kWidth];
    for (uint d = 0; d < kWidth; ++d) {
      column_wipes[d] = d0 + d < dim ? wipe_mask[d0 + d] : 0ul;
    }
    // The tiles are complete before any thread reads them.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint n = 0; n < kEntries; ++n) {
      const uint e = tid + n * kChunkThreads;
      const uint first = e / (kSub * kSub) * kSub;
      const uint i = first + e / kSub % kSub;
      const uint j = first + e % kSub;
      if (j > i) {
        continue;
      }
      for (uint d = 0; d < kWidth; ++d) {
        const uint at_i = i * kWidth + d;
        const uint at_j = j * kWidth + d;
        const float decay = wiped_between(column_wipes[d], int(j), i)
                                ? 0.0f
                                : exp(cumsum_tile[at_i] - cumsum_tile[at_j]);
        diagonal[n] += a_tile[at_i] * decay * b_tile[at_j];
      }
    }
    // Every thread is done reading before the next columns overwrite the tiles.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // Left of the diagonal blocks, the products. The staged rows: rows
  // kSub..63 of a, each times decay(i, p, c) of its sub-chunk; then, for
  // sub-chunk s = 1, 2, 3 in turn, rows 0..p-1 of b, each times decay(p, j,
  // c) with p = s kSub (sub-chunk s's columns start at row kSub s (s - 1) / 2).
  constexpr uint kFactoredRows = kChunkSize - kSub;
  constexpr uint kFactoredColumns = kSub * kSubChunks * (kSubChunks - 1) / 2;
  constexpr uint kFactored = (kFactoredRows + kFactoredColumns) * kWidth;
  threadgroup float* row_tile = tiles;
  threadgroup float* column_tile = tiles + kFactoredRows * kWidth;
  const uint sub_chunk = simd_index * 8 / kSub;
  const uint left_blocks = sub_chunk * kSub / 8;
  simdgroup_matrix<float, 8, 8> acc[kFactoredRows / 8];
  for (uint n = 0; n < kFactoredRows / 8; ++n) {
    acc[n] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  for (uint d0 = 0; d0 < dim; d0 += kWidth) {
    for (uint e = tid; e < kFactored; e += kChunkThreads) {
      const uint row = e / kWidth;
      const uint column = d0 + e % kWidth;
      float value = 0.0f;
      if (row < kFactoredRows) {
        // a_ic decay(i, p, c): a wipe in (p, i] zeroes it.
        const uint i = kSub + row;
        const uint p = i / kSub * kSub;
        if (i < rows && column < dim) {
          const uint at = i * dim + column;
          const float decay = wiped_between(wipe_mask[column], int(p), i)
                                  ? 0.0f
                                  : exp(cumsum[at] - cumsum[p * dim + column]);
          value = float(a_rows[i * row_stride + column]) * decay;
        }
      } else {
        // b_jc decay(p, j, c): a wipe in (j, p] zeroes it. Row p may lie past
        // a short chunk's last token (gate_cumsum writes all 64 rows); the
        // rows from p on are 0 in the product then.
        const uint r = row - kFactoredRows;
        uint s = 1;
        while (r >= kSub * s * (s + 1) / 2) {
          ++s;
        }
        const uint j = r - kSub * s * (s - 1) / 2;
        const uint p = s * kSub;
        if (j < rows && column < dim) {
          const uint at = p * dim + column;
          const float decay = wiped_between(wipe_mask[column], int(j), p)
                                  ? 0.0f
                                  : exp(cumsum[at] - cumsum[j * dim + column]);
          value = float(b_rows[j * row_stride + column]) * decay;
        }
      }
      tiles[e] = value;
    }
    // The factored tiles are complete before any SIMD-group reads them.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sub_chunk > 0) {
      const threadgroup float* columns =
          column_tile + kSub * sub_chunk * (sub_chunk - 1) / 2 * kWidth;
      for (uint d = 0; d < kWidth; d += 8) {
        simdgroup_matrix<float, 8, 8> a;
        simdgroup_load(a, row_tile + (simd_index * 8 - kSub) * kWidth + d, kWidth);
        for (uint n = 0; n < kFactoredRows / 8; ++n) {
          if (n < left_blocks) {
            // Columns n*8.. of sub-chunk s, read transposed.
            simdgroup_matrix<float, 8, 8> b;
            simdgroup_load(b, columns + n * 8 * kWidth + d, kWidth, ulong2(0, 0), true);
            simdgroup_multiply_accumulate(acc[n], a, b, acc[n]);
          }
        }
      }
    }
    // Every SIMD-group is done reading before the next columns overwrite the tiles.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // Each entry written once: the products left of the diagonal blocks, the
  // pairs in them, 0 right of them.
  for (uint n = 0; n < kFactoredRows / 8; ++n) {
    if (n < left_blocks) {
      simdgroup_store(acc[n], result + simd_index * 8 * kChunkSize + n * 8, kChunkSize);
    }
  }
  for (uint n = 0; n < kEntries; ++n) {
    const uint e = tid + n * kChunkThreads;
    const uint first = e / (kSub * kSub) * kSub;
    result[(first + e / kSub % kSub) * kChunkSize + first + e % kSub] = diagonal[n];
  }
  for (uint e = tid; e < kChunkSize * kChunkSize; e += kChunkThreads) {
    const uint i = e / kChunkSize;
    const uint j = e % kChunkSize;
    if (j >= (i / kSub + 1) * kSub) {
      result[e] = 0.0f;
    }
  }
  // The result is complete before any thread reads it.
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
