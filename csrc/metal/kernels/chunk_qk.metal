// chunk_qk: Q K^T of one chunk of one key head (q and k normalised when
// asked), for chunk_output's intra-chunk term. Only j <= i is read later.

#include "gated_delta_common.h"

template <typename T>
[[kernel]] void gated_delta_chunk_qk(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device float* query_inverse_norm [[buffer(2)]],
    const device float* key_inverse_norm [[buffer(3)]],
    device float* qk [[buffer(4)]],
    constant GatedDeltaKernelParams& p [[buffer(5)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint simd_index [[simdgroup_index_in_threadgroup]]) {
  threadgroup float q_tile[kChunkSize * kDotTileWidth];
  threadgroup float k_tile[kChunkSize * kDotTileWidth];
  threadgroup float products[kChunkSize * kChunkSize];
  const uint chunk = group.x;
  const uint kh = group.y;
  const uint b = group.z;
  const uint length = chunk_length(p, chunk);
  const uint first_token = chunk * kChunkSize;
  const uint offset = qk_offset(p, b, first_token, kh);
  const uint row_stride = p.key_heads * p.key_dim;

  chunk_dot_products<kDotTileWidth>(q + offset, k + offset, row_stride, length, p.key_dim,
                                    q_tile, k_tile, products, tid, simd_index);
  const uint out = chunk_row(p, b, kh, p.key_heads, chunk) * kChunkSize;
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
