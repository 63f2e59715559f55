// chunk_output_backward: the gradient of chunk_output's intra-chunk sum, for
// every chunk at once (it does not need dS). Per chunk of one (batch, value
// head), with dO = scale dy (0 where masked), M = decay o Q K^T (lower, with
// the diagonal) and V' the chunk's deltas (chunk_carry's U):
//
//   dV' = M^T dO;   dM = dO V'^T;   dMd = dM o decay
//   dq = dMd K;     dk = dMd^T Q;   P_ij = dM_ij (q_i . k_j)  (j < i)
//
// It starts the chunk's per-value-head dq and dk and dV', which
// chunk_carry_backward, recompute_w_u_backward and kkt_inverse_backward add
// to, and writes the chunk's tile of the decays' pair terms: P_ij, decay(i,
// j)'s gradient without the decay (0 on and above the diagonal), which
// chunk_carry_backward and kkt_inverse_backward add to and
// gate_cumsum_backward scans. Chunks with a decay that is not a normal float
// are left to the recurrent reverse (chunk_decays_normal).
//
// Per-key gates (p.per_key_gates): M = chunk_qk's tile of the value head,
// decayed per key channel, gives dV' as it is; dM itself (with its
// diagonal) goes to qk_grad for channel_pairs_backward, which forms dq =
// R(dM, K) and dk = C(dM, Q) with a decay per channel and the decays'
// gradients. This kernel then starts dq and dk at 0.
//
// One threadgroup of kChunkThreads per (chunk, value head, batch); the 64 x 64
// dMd is staged in threadgroup memory.

#include "backward_common.h"

template <typename T>
[[kernel]] void gated_delta_chunk_output_backward(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device ulong* tiny_decay_mask [[buffer(2)]],
    const device bool* mask [[buffer(3)]],
    const device float* query_inverse_norm [[buffer(4)]],
    const device float* key_inverse_norm [[buffer(5)]],
    const device float* gate_cumsum [[buffer(6)]],
    const device float* qk [[buffer(7)]],
    const device float* corrected [[buffer(8)]],
    const device T* y_cotangent [[buffer(9)]],
    device float* d_corrected [[buffer(10)]],
    device float* decay_pair_terms [[buffer(11)]],
    device float* query_head_grad [[buffer(12)]],
    device float* key_head_grad [[buffer(13)]],
    constant GatedDeltaKernelParams& p [[buffer(14)]],
    device float* qk_grad [[buffer(15)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float dm[kChunkSize * kChunkSize];
  const uint chunk = group.x;
  const uint h = group.y;
  const uint b = group.z;
  if (!chunk_decays_normal(tiny_decay_mask, p, b, h, chunk)) {
    return;
  }
  const uint kh = key_head_of(p, h);
  const uint length = chunk_length(p, chunk);
  const uint start = chunk * kChunkSize;
  const uint rows = chunk_row(p, b, h, p.value_heads, chunk);
  const bool per_key = p.per_key_gates != 0;
  // chunk_qk's tiles: per key head, or per value head with per-key gates.
  const uint tile = (per_key ? rows : chunk_row(p, b, kh, p.key_heads, chunk)) * kChunkSize;
  const device float* cumsum = gate_cumsum + rows;

  // dM_ij = dO_i . V'_j on the lower triangle: its pair term, then dMd.
  for (uint e = tid; e < kChunkSize * kChunkSize; e += kChunkThreads) {
    const uint i = e / kChunkSize;
    const uint j = e % kChunkSize;
    const bool lower = j <= i && i < length;
    float sum = 0.0f;
    if (lower && !token_is_masked(p, mask, b, start + i)) {
      const uint dy_row = v_offset(p, b, start + i, h);
      for (uint c = 0; c < p.value_dim; ++c) {
        sum += float(y_cotangent[dy_row + c]) * corrected[(rows + j) * p.value_dim + c];
      }
      sum *= p.scale;
    }
    if (per_key) {
      qk_grad[rows * kChunkSize + e] = sum;
      continue;
    }
    decay_pair_terms[rows * kChunkSize + e] = j < i && i < length ? sum * qk[tile + e] : 0.0f;
    dm[e] = lower ? sum * exp(cumsum[i] - cumsum[j]) : 0.0f;
  }
  // dMd is complete before the products read it.
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (uint e = tid; e < length * p.value_dim; e += kChunkThreads) {
    const uint j = e / p.value_dim;
    const uint c = e % p.value_dim;
    float sum = 0.0f;
    for (uint i = j; i < length; ++i) {
      if (!token_is_masked(p, mask, b, start + i)) {
        const float decay = per_key ? 1.0f : exp(cumsum[i] - cumsum[j]);
        const float weight = decay * qk[tile + i * kChunkSize + j];
        sum += weight * p.scale * float(y_cotangent[v_offset(p, b, start + i, h) + c]);
      }
    }
    d_corrected[(rows + j) * p.value_dim + c] = sum;
  }
  for (uint e = tid; e < length * p.key_dim; e += kChunkThreads) {
    const uint i = e / p.key_dim;
    const uint c = e % p.key_dim;
    float dq = 0.0f;
    float dk = 0.0f;
    for (uint j = 0; j <= i && !per_key; ++j) {
      dq += dm[i * kChunkSize + j] * normalized_key(k, key_inverse_norm, p, b, start + j, kh, c);
    }
    for (uint m = i; m < length && !per_key; ++m) {
      dk += dm[m * kChunkSize + i] * normalized_key(q, query_inverse_norm, p, b, start + m, kh, c);
    }
    const uint head_grad = ((b * p.tokens + start + i) * p.value_heads + h) * p.key_dim + c;
    query_head_grad[head_grad] = dq;
    key_head_grad[head_grad] = dk;
  }
}

instantiate_kernel("gated_delta_chunk_output_backward_float32", gated_delta_chunk_output_backward, float)
instantiate_kernel("gated_delta_chunk_output_backward_float16", gated_delta_chunk_output_backward, half)
instantiate_kernel("gated_delta_chunk_output_backward_bfloat16", gated_delta_chunk_output_backward, bfloat)
