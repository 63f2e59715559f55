// kkt_inverse_backward: the gradient of T = (I + A)^-1, A_ij = beta_i
// decay(i, j) k_i . k_j (j < i), for every chunk at once, from dT
// (recompute_w_u_backward):
//
//   dA = -T^T dT T^T on the strictly lower triangle
//   with dAk = dA o beta_i decay(i, j):
//   dk += dAk K + dAk^T K;  dbeta_i += sum_j dA_ij decay(i, j) k_i . k_j
//
// and adds decay(i, j)'s gradient without it, beta_i dA_ij k_i . k_j, to the
// pair terms of gate_cumsum_backward. Chunks with a decay that is not a
// normal float are left to the recurrent reverse. One threadgroup of
// kChunkThreads per (chunk, value head, batch), with T and X = dT T^T staged
// in threadgroup memory (then dAk and dbeta's terms in their place): 32 KiB,
// Metal's limit.
//
// Per-key gates (p.per_key_gates): A_ij = beta_i sum_c k_ic k_jc decay(i, j,
// c) has a decay per key channel inside its sum, so this kernel writes dA
// alone (kkt_grad, strictly lower, 0 elsewhere) and channel_pairs_backward
// takes dk, dbeta and the decays' gradients from it.

#include "backward_common.h"

GATED_DELTA_ABI_CONSTANT uint kKktElementsPerThread = kChunkSize * kChunkSize / kChunkThreads;

template <typename T>
[[kernel]] void gated_delta_kkt_inverse_backward(
    const device T* k [[buffer(0)]],
    const device ulong* tiny_decay_mask [[buffer(1)]],
    const device float* key_inverse_norm [[buffer(3)]],
    const device float* gate_cumsum [[buffer(4)]],
    const device float* beta_effective [[buffer(5)]],
    const device float* kkt_inverse [[buffer(6)]],
    const device float* dt [[buffer(7)]],
    device float* decay_pair_terms [[buffer(8)]],
    device float* key_head_grad [[buffer(9)]],
    device float* dbeta [[buffer(10)]],
    constant GatedDeltaKernelParams& p [[buffer(11)]],
    device float* kkt_grad [[buffer(12)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float t_tile[kChunkSize * kChunkSize];  // T, then dAk
  threadgroup float x_tile[kChunkSize * kChunkSize];  // dT T^T, then dbeta's terms
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
  const device float* cumsum = gate_cumsum + rows;
  const device float* beta = beta_effective + rows;
  const device float* d_inverse = dt + rows * kChunkSize;

  for (uint e = tid; e < kChunkSize * kChunkSize; e += kChunkThreads) {
    t_tile[e] = kkt_inverse[rows * kChunkSize + e];
  }
  // T is staged before X reads it.
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // X_ij = sum_m dT_im T_jm: both lower, so m <= min(i, j).
  for (uint e = tid; e < kChunkSize * kChunkSize; e += kChunkThreads) {
    const uint i = e / kChunkSize;
    const uint j = e % kChunkSize;
    float sum = 0.0f;
    for (uint m = 0; m <= min(i, j); ++m) {
      sum += d_inverse[i * kChunkSize + m] * t_tile[j * kChunkSize + m];
    }
    x_tile[e] = sum;
  }
  // X is complete before dA reads it.
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float scaled[kKktElementsPerThread];
  float terms[kKktElementsPerThread];
  for (uint n = 0; n < kKktElementsPerThread; ++n) {
    const uint e = tid + n * kChunkThreads;
    const uint i = e / kChunkSize;
    const uint j = e % kChunkSize;
    scaled[n] = 0.0f;
    terms[n] = 0.0f;
    float da = 0.0f;  // dA_ij = -sum_{m >= i} T_mi X_mj
    if (j < i && i < length) {
      for (uint m = i; m < length; ++m) {
        da -= t_tile[m * kChunkSize + i] * x_tile[m * kChunkSize + j];
      }
    }
    if (p.per_key_gates != 0) {
      kkt_grad[rows * kChunkSize + e] = da;
      continue;
    }
    if (j < i && i < length) {
      const float decayed = exp(cumsum[i] - cumsum[j]) * da;
      float gram = 0.0f;
      for (uint c = 0; c < p.key_dim; ++c) {
        gram += normalized_key(k, key_inverse_norm, p, b, start + i, kh, c) *
                normalized_key(k, key_inverse_norm, p, b, start + j, kh, c);
      }
      scaled[n] = beta[i] * decayed;
      terms[n] = decayed * gram;
      decay_pair_terms[rows * kChunkSize + e] += beta[i] * da * gram;
    }
  }
  // Uniform per threadgroup: per-key gates stop at dA.
  if (p.per_key_gates != 0) {
    return;
  }
  // Every read of T and X is done before dAk and dbeta's terms take their place.
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint n = 0; n < kKktElementsPerThread; ++n) {
    t_tile[tid + n * kChunkThreads] = scaled[n];
    x_tile[tid + n * kChunkThreads] = terms[n];
  }
  // dAk and dbeta's terms are complete before the sums read them.
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < length) {
    const uint i = tid;
    float row_sum = 0.0f;
    for (uint j = 0; j < i; ++j) {
      row_sum += x_tile[i * kChunkSize + j];
    }
    dbeta[gate_offset(p, b, start + i, h)] += row_sum;
  }
  for (uint e = tid; e < length * p.key_dim; e += kChunkThreads) {
    const uint i = e / p.key_dim;
    const uint c = e % p.key_dim;
    float sum = 0.0f;
    for (uint j = 0; j < i; ++j) {
      sum += t_tile[i * kChunkSize + j] * normalized_key(k, key_inverse_norm, p, b, start + j, kh, c);
    }
    for (uint m = i + 1; m < length; ++m) {
      sum += t_tile[m * kChunkSize + i] * normalized_key(k, key_inverse_norm, p, b, start + m, kh, c);
    }
    key_head_grad[((b * p.tokens + start + i) * p.value_heads + h) * p.key_dim + c] += sum;
  }
}

instantiate_kernel("gated_delta_kkt_inverse_backward_float32", gated_delta_kkt_inverse_backward, float)
instantiate_kernel("gated_delta_kkt_inverse_backward_float16", gated_delta_kkt_inverse_backward, half)
instantiate_kernel("gated_delta_kkt_inverse_backward_bfloat16", gated_delta_kkt_inverse_backward, bfloat)
