// chunk_qk: Q K^T of one chunk of one key head (q and k normalised when
// asked), for chunk_output's intra-chunk term. Only j <= i is read later.
// Per-key gates: one tile per value head, decayed per key channel,
// sum_c q_ic k_jc decay(i, j, c) (key_decayed_grams), so chunk_output
// applies no decay of its own.

#include "gated_delta_common.h"

// The grid's y is the key head, or the value head with per-key gates.
template <typename T>
[[kernel]] void gated_delta_chunk_qk(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device float* query_inverse_norm [[buffer(2)]],
    const device float* key_inverse_norm [[buffer(3)]],
    device float* qk [[buffer(4)]],
    constant GatedDeltaKernelParams& p [[buffer(5)]],
    const device float* gate_cumsum [[buffer(6)]],
    const device ulong* wipe_mask [[buffer(7)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint simd_index [[simdgroup_index_in_threadgroup]]) {
  // The dot-product tiles, or the per-key staging blocks in the same bytes.
  threadgroup float tiles[2 * kChunkSize * kDotTileWidth];
  threadgroup float products[kChunkSize * kChunkSize];
  const uint chunk = group.x;
  const uint head = group.y;
  const uint b = group.z;
  const bool per_key = p.per_key_gates != 0;
  const uint kh = per_key ? key_head_of(p, head) : head;
  const uint heads = per_key ? p.value_heads : p.key_heads;
  const uint length = chunk_length(p, chunk);
  const uint first_token = chunk * kChunkSize;
  const uint offset = qk_offset(p, b, first_token, kh);
  const uint row_stride = p.key_heads * p.key_dim;
  const uint out = chunk_row(p, b, head, heads, chunk) * kChunkSize;

  if (per_key) {
    const uint rows = chunk_row(p, b, head, p.value_heads, chunk);
    key_decayed_grams(q + offset, k + offset, row_stride, length, p.key_dim,
                      gate_cumsum + rows * p.key_dim, wipe_mask + rows / kChunkSize * p.key_dim,
                      tiles, products, tid, simd_index);
  } else {
    chunk_dot_products<kDotTileWidth>(q + offset, k + offset, row_stride, length, p.key_dim,
                                      tiles, tiles + kChunkSize * kDotTileWidth, products, tid,
                                      simd_index);
  }
  for (uint e = tid; e < kChunkSize * kChunkSize; e += kChunkThreads) {
    const uint i = e / kChunkSize;
    const uint j = e % kChunkSize;
    float value = products[e];
    if (p.normalize_qk != 0 && i < length && j < length) {
      const uint norms = (b * p.tokens + first_token) * p.key_heads + kh;
      value *= query_inverse_norm[norms + i * p.key_heads] *
               key_inverse_norm[norms + j * p.key_heads];
    }
    qk[out + e] = value;
  }
}

instantiate_kernel("gated_delta_chunk_qk_float32", gated_delta_chunk_qk, float)
instantiate_kernel("gated_delta_chunk_qk_float16", gated_delta_chunk_qk, half)
instantiate_kernel("gated_delta_chunk_qk_bfloat16", gated_delta_chunk_qk, bfloat)
