// k_gram: K K^T of one chunk of one key head (k normalised when asked), shared
// by the value heads that read that key head. Used where it pays
// (uses_chunk_k_gram_k128: Dk == 128 with repeated heads); otherwise
// kkt_inverse builds the gram itself.

#include "gated_delta_common.h"

template <typename T>
[[kernel]] void gated_delta_k_gram(
    const device T* k [[buffer(0)]],
    const device float* key_inverse_norm [[buffer(1)]],
    device float* k_gram [[buffer(2)]],
    constant GatedDeltaKernelParams& p [[buffer(3)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint simd_index [[simdgroup_index_in_threadgroup]]) {
  threadgroup float a_tile[kChunkSize * kDotTileWidth];
  threadgroup float b_tile[kChunkSize * kDotTileWidth];
  threadgroup float gram[kChunkSize * kChunkSize];
  const uint chunk = group.x;
  const uint kh = group.y;
  const uint b = group.z;
  const uint length = chunk_length(p, chunk);
  const uint first_token = chunk * kChunkSize;
  const device T* rows = k + qk_offset(p, b, first_token, kh);
  const uint row_stride = p.key_heads * p.key_dim;

  chunk_dot_products<kDotTileWidth>(rows, rows, row_stride, length, p.key_dim, a_tile, b_tile,
                                    gram, tid, simd_index);
  const uint out = chunk_row(p, b, kh, p.key_heads, chunk) * kChunkSize;
  for (uint e = tid; e < kChunkSize * kChunkSize; e += kChunkThreads) {
    const uint i = e / kChunkSize;
    const uint j = e % kChunkSize;
    float value = gram[e];
    if (p.normalize_qk != 0 && i < length && j < length) {
      const uint norms = (b * p.tokens + first_token) * p.key_heads + kh;
      value *= key_inverse_norm[norms + i * p.key_heads] * key_inverse_norm[norms + j * p.key_heads];
    }
    k_gram[out + e] = value;
  }
}

instantiate_kernel("gated_delta_k_gram_float32", gated_delta_k_gram, float)
instantiate_kernel("gated_delta_k_gram_float16", gated_delta_k_gram, half)
instantiate_kernel("gated_delta_k_gram_bfloat16", gated_delta_k_gram, bfloat)
