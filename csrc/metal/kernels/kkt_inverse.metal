// kkt_inverse: per chunk of one (batch, value head), the decayed, beta-scaled
// strictly lower triangular A and T = (I + A)^-1 (unit lower triangular):
//
//   A_ij = beta_i decay(i, j) (k_i . k_j)   for j < i, else 0
//
// T is what the WY form needs: U = T diag(beta) V, W = T diag(beta Gamma) K.
// Per-key gates: A_ij = beta_i sum_c k_ic k_jc decay(i, j, c), the decayed
// gram built here in sub-chunks (key_decayed_grams; k_gram does not run).

#include "gated_delta_common.h"

// kFromKGram: read the gram k_gram wrote for the key head (Dk == 128 with
// repeated heads); otherwise build it here from K.
template <typename T, bool kFromKGram>
[[kernel]] void gated_delta_kkt_inverse(
    const device T* k [[buffer(0)]],
    const device float* key_inverse_norm [[buffer(1)]],
    const device float* k_gram [[buffer(2)]],
    const device float* gate_cumsum [[buffer(3)]],
    const device ulong* wipe_mask [[buffer(4)]],
    const device float* beta_effective [[buffer(5)]],
    device float* kkt_inverse [[buffer(6)]],
    constant GatedDeltaKernelParams& p [[buffer(7)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint simd_index [[simdgroup_index_in_threadgroup]]) {
  threadgroup float a[kChunkSize * kChunkSize];
  // The dot-product tiles, or the per-key staging blocks in the same bytes.
  threadgroup float tiles[2 * kChunkSize * kDotTileWidth];
  const uint chunk = group.x;
  const uint h = group.y;
  const uint b = group.z;
  const uint kh = key_head_of(p, h);
  const uint length = chunk_length(p, chunk);
  const uint first_token = chunk * kChunkSize;
  const uint rows = chunk_row(p, b, h, p.value_heads, chunk);
  const device float* cumsum = gate_cumsum + rows * gate_width(p);
  const device ulong* wipe = wipe_mask + rows / kChunkSize * gate_width(p);

  // The gram k_i . k_j first (per-key gates: decayed), in `a`.
  if (p.per_key_gates != 0) {
    const device T* key_rows = k + qk_offset(p, b, first_token, kh);
    key_decayed_grams(key_rows, key_rows, p.key_heads * p.key_dim, length, p.key_dim, cumsum,
                      wipe, tiles, a, tid, simd_index);
  } else if (kFromKGram) {
    const uint tile = chunk_row(p, b, kh, p.key_heads, chunk) * kChunkSize;
    for (uint e = tid; e < kChunkSize * kChunkSize; e += kChunkThreads) {
      a[e] = k_gram[tile + e];
    }
  } else {
    const device T* key_rows = k + qk_offset(p, b, first_token, kh);
    chunk_dot_products<kDotTileWidth>(key_rows, key_rows, p.key_heads * p.key_dim, length,
                                      p.key_dim, tiles, tiles + kChunkSize * kDotTileWidth, a,
                                      tid, simd_index);
  }
  // Then A in place: each thread rewrites only the entries it reads.
  for (uint e = tid; e < kChunkSize * kChunkSize; e += kChunkThreads) {
    const uint i = e / kChunkSize;
    const uint j = e % kChunkSize;
    float value = 0.0f;
    if (j < i && i < length) {
      const float decay = p.per_key_gates != 0 ? 1.0f : chunk_decay(cumsum, wipe, i, j);
      value = beta_effective[rows + i] * decay * a[e];
      if (!kFromKGram && p.normalize_qk != 0) {
        const uint norms = (b * p.tokens + first_token) * p.key_heads + kh;
        value *= key_inverse_norm[norms + i * p.key_heads] *
                 key_inverse_norm[norms + j * p.key_heads];
      }
    }
    a[e] = value;
  }
  // A is complete before the columns of T are solved from it.
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Column m of T by forward substitution, one thread per column (columns
  // are independent): T_mm = 1, T_jm = -sum_{m <= l < j} A_jl T_lm.
  if (tid < kChunkSize) {
    const uint m = tid;
    float column[kChunkSize];
    const uint out = rows * kChunkSize;
    for (uint j = 0; j < kChunkSize; ++j) {
      float value = 0.0f;
      if (j == m) {
        value = 1.0f;
      } else if (j > m) {
        for (uint l = m; l < j; ++l) {
          value -= a[j * kChunkSize + l] * column[l];
        }
      }
      column[j] = value;
      kkt_inverse[out + j * kChunkSize + m] = value;
    }
  }
}

instantiate_kernel("gated_delta_kkt_inverse_float32", gated_delta_kkt_inverse, float, false)
instantiate_kernel("gated_delta_kkt_inverse_float16", gated_delta_kkt_inverse, half, false)
instantiate_kernel("gated_delta_kkt_inverse_bfloat16", gated_delta_kkt_inverse, bfloat, false)
instantiate_kernel("gated_delta_kkt_inverse_from_k_gram_float32", gated_delta_kkt_inverse, float, true)
instantiate_kernel("gated_delta_kkt_inverse_from_k_gram_float16", gated_delta_kkt_inverse, half, true)
instantiate_kernel("gated_delta_kkt_inverse_from_k_gram_bfloat16", gated_delta_kkt_inverse, bfloat, true)
