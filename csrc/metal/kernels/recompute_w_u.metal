// recompute_w_u: the WY form of one chunk of one (batch, value head):
//
//   U = T diag(beta) V            [L, Dv]
//   W = T diag(beta Gamma) K      [L, Dk]   Gamma_j: decay from the chunk entry
//
// (per-key gates: W = T diag(beta) (Gamma o K), Gamma_jc the decay of channel
// c from the chunk entry) so that the chunk's corrected values are
// v' = U - W S^T for the state S the chunk starts from (chunk_carry).
// Independent of S: all chunks in parallel.

#include "gated_delta_common.h"

template <typename T>
[[kernel]] void gated_delta_recompute_w_u(
    const device T* k [[buffer(0)]],
    const device T* v [[buffer(1)]],
    const device float* key_inverse_norm [[buffer(2)]],
    const device float* gate_cumsum [[buffer(3)]],
    const device ulong* wipe_mask [[buffer(4)]],
    const device float* beta_effective [[buffer(5)]],
    const device float* kkt_inverse [[buffer(6)]],
    device float* w [[buffer(7)]],
    device float* u [[buffer(8)]],
    constant GatedDeltaKernelParams& p [[buffer(9)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float t_tile[kChunkSize * kChunkSize];
  threadgroup float value_weight[kChunkSize];
  threadgroup float key_weight[kChunkSize];
  const uint chunk = group.x;
  const uint h = group.y;
  const uint b = group.z;
  const uint kh = key_head_of(p, h);
  const uint length = chunk_length(p, chunk);
  const uint first_token = chunk * kChunkSize;
  const uint rows = chunk_row(p, b, h, p.value_heads, chunk);
  const bool per_key = p.per_key_gates != 0;
  const device float* cumsum = gate_cumsum + rows * gate_width(p);
  const device ulong* wipe = wipe_mask + rows / kChunkSize * gate_width(p);

  for (uint e = tid; e < kChunkSize * kChunkSize; e += kChunkThreads) {
    t_tile[e] = kkt_inverse[rows * kChunkSize + e];
  }
  if (tid < kChunkSize) {
    const uint j = tid;
    float beta_j = beta_effective[rows + j];
    float key_scale = 1.0f;
    if (p.normalize_qk != 0 && j < length) {
      key_scale = key_inverse_norm[(b * p.tokens + first_token + j) * p.key_heads + kh];
    }
    value_weight[j] = beta_j;
    // Per-key gates: the decay is a column's, applied below.
    const float decay = per_key ? 1.0f : decay_from_chunk_start(cumsum, wipe, j);
    key_weight[j] = beta_j * decay * key_scale;
  }
  // T and the row weights are staged before any output reads them.
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const uint value_rows = p.value_heads * p.value_dim;
  for (uint e = tid; e < length * p.value_dim; e += kChunkThreads) {
    const uint i = e / p.value_dim;
    const uint column = e % p.value_dim;
    const uint source = v_offset(p, b, first_token, h) + column;
    float sum = 0.0f;
    for (uint j = 0; j <= i; ++j) {
      sum += t_tile[i * kChunkSize + j] * value_weight[j] * float(v[source + j * value_rows]);
    }
    u[(rows + i) * p.value_dim + column] = sum;
  }
  const uint key_rows = p.key_heads * p.key_dim;
  for (uint e = tid; e < length * p.key_dim; e += kChunkThreads) {
    const uint i = e / p.key_dim;
    const uint column = e % p.key_dim;
    const uint source = qk_offset(p, b, first_token, kh) + column;
    float sum = 0.0f;
    for (uint j = 0; j <= i; ++j) {
      float k_jc = float(k[source + j * key_rows]);
      if (per_key) {
        k_jc *= channel_decay(p, cumsum, wipe, j, -1, column);
      }
      sum += t_tile[i * kChunkSize + j] * key_weight[j] * k_jc;
    }
    w[(rows + i) * p.key_dim + column] = sum;
  }
}

instantiate_kernel("gated_delta_recompute_w_u_float32", gated_delta_recompute_w_u, float)
instantiate_kernel("gated_delta_recompute_w_u_float16", gated_delta_recompute_w_u, half)
instantiate_kernel("gated_delta_recompute_w_u_bfloat16", gated_delta_recompute_w_u, bfloat)
