// channel_pairs_backward: the chunked backward's last WY stage with per-key
// gates, for every chunk at once, in place of gate_cumsum_backward. With a
// decay per key channel, decay(i, j, c) = prod_{j < s <= i} gamma_sc, the
// products that carry one cannot take it outside a sum over the channels,
// so they are taken here per channel c, one thread per channel walking the
// chunk's pairs (i, t), t <= i, with the decays as running products of the
// gates (no exponential of a difference: exact where a gate is tiny). From
// the scalar tiles dM (qk_grad, chunk_output_backward) and dA (kkt_grad,
// kkt_inverse_backward):
//
//   chunk_output:  dq_ic += sum_t dM_it decay(i, t, c) k_tc        (R(dM, K))
//                  dk_tc += sum_i dM_it decay(i, t, c) q_ic        (C(dM, Q))
//   kkt_inverse:   A_it = beta_i sum_c k_ic k_tc decay(i, t, c), t < i, so with
//                  R_ic = sum_t dA_it decay(i, t, c) k_tc:
//                  dk_ic += beta_i R_ic;  dbeta_i += k_i . R_i
//                  dk_tc += sum_i beta_i dA_it decay(i, t, c) k_ic  (C(dKd, K))
//   gate_cumsum:   dgamma_tc = sum_{i >= t > j} P_ijc decay(i, t, c)
//                  decay(t-1, j, c) and dg_tc = gamma_tc dgamma_tc, the scan
//                  of gate_cumsum_backward per channel, from the pair terms
//                  P_itc = (dM_it q_ic + beta_i dA_it k_ic) k_tc, the entry
//                  terms P_{i,-1,c} (chunk_carry_backward and
//                  recompute_w_u_backward) and the exit terms, which add to
//                  P_{L-1,t,c} (chunk_carry_backward).
//
// Row i's scan carries H_it = sum_{j < t} P_ijc decay(t-1, j, c) (H_i0 =
// P_{i,-1,c}, H_{i,t+1} = gamma_tc H_it + P_itc), and dgamma_tc gains
// decay(i, t, c) H_it. q and k are the normalised rows. Masked tokens decay
// by 1 (as gate_cumsum takes them) and get exactly zero dq, dk (per value
// head), dg, dgamma and dbeta. Chunks with a decay that is not a normal float
// are left to the recurrent reverse (chunk_decays_normal).
//
// One threadgroup of kChunkThreads per (chunk, value head, batch), thread c
// taking key channel c (Dk <= kMaxChunkedKeyDim <= kChunkThreads): its
// channel's decays, keys and sums over the chunk's tokens in thread memory
// (64 floats each), no threadgroup memory. The dbeta terms k_ic R_ic take
// the entry terms' place once read (each by the thread of its channel) and
// are summed over the channels per token.

#include "backward_common.h"

template <typename T>
[[kernel]] void gated_delta_channel_pairs_backward(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device float* g [[buffer(2)]],
    const device bool* mask [[buffer(3)]],
    const device float* query_inverse_norm [[buffer(4)]],
    const device float* key_inverse_norm [[buffer(5)]],
    const device float* beta_effective [[buffer(6)]],
    const device float* qk_grad [[buffer(7)]],
    const device float* kkt_grad [[buffer(8)]],
    device float* decay_entry_terms [[buffer(9)]],
    const device float* decay_exit_terms [[buffer(10)]],
    device float* dg [[buffer(11)]],
    device float* dgamma [[buffer(12)]],
    device float* dbeta [[buffer(13)]],
    device float* query_head_grad [[buffer(14)]],
    device float* key_head_grad [[buffer(15)]],
    constant GatedDeltaKernelParams& p [[buffer(16)]],
    const device ulong* tiny_decay_mask [[buffer(17)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
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
  const device float* beta = beta_effective + rows;
  const device float* d_output = qk_grad + rows * kChunkSize;
  const device float* d_inverse = kkt_grad + rows * kChunkSize;
  const uint c = tid;

  if (c < p.key_dim) {
    // Per token t of the chunk, this channel's k_tc and gamma_tc, decay(i,
    // t, c) for the row i in hand, and the sums dgamma_tc and dk_tc (its C
    // products) over the rows.
    float keys[kChunkSize];
    float gammas[kChunkSize];
    float to_row[kChunkSize];
    float d_gamma[kChunkSize];
    float d_key[kChunkSize];
    for (uint t = 0; t < length; ++t) {
      const bool masked = token_is_masked(p, mask, b, start + t);
      keys[t] = normalized_key(k, key_inverse_norm, p, b, start + t, kh, c);
      gammas[t] = masked ? 1.0f : exp(g[key_gate_offset(p, gate_offset(p, b, start + t, h), c)]);
      d_gamma[t] = 0.0f;
      d_key[t] = 0.0f;
    }
    for (uint i = 0; i < length; ++i) {
      for (uint t = 0; t < i; ++t) {
        to_row[t] *= gammas[i];
      }
      to_row[i] = 1.0f;
      const float query = normalized_key(q, query_inverse_norm, p, b, start + i, kh, c);
      const float key = keys[i];
      const uint terms = (rows + i) * p.key_dim + c;
      float scan = decay_entry_terms[terms];  // H_i0
      float query_sum = 0.0f;  // R(dM, K)_ic
      float key_sum = 0.0f;  // R_ic, of dA
      for (uint t = 0; t <= i; ++t) {
        const float decay = to_row[t];
        const float dm = d_output[i * kChunkSize + t];
        const float da = d_inverse[i * kChunkSize + t];  // 0 on the diagonal
        const float pair = dm * query + beta[i] * da * key;  // P_itc / k_tc
        d_gamma[t] += decay * scan;
        d_key[t] += decay * pair;
        query_sum += decay * dm * keys[t];
        key_sum += decay * da * keys[t];
        if (t < i) {
          scan = gammas[t] * scan + keys[t] * pair;
          if (i == length - 1) {
            scan += decay_exit_terms[(rows + t) * p.key_dim + c];
          }
        }
      }
      const uint head_grad = ((b * p.tokens + start + i) * p.value_heads + h) * p.key_dim + c;
      query_head_grad[head_grad] += query_sum;
      key_head_grad[head_grad] += beta[i] * key_sum;
      decay_entry_terms[terms] = key * key_sum;
    }
    for (uint t = 0; t < length; ++t) {
      const uint head_grad = ((b * p.tokens + start + t) * p.value_heads + h) * p.key_dim + c;
      const uint gate = key_gate_offset(p, gate_offset(p, b, start + t, h), c);
      if (token_is_masked(p, mask, b, start + t)) {
        query_head_grad[head_grad] = 0.0f;
        key_head_grad[head_grad] = 0.0f;
        dgamma[gate] = 0.0f;
        dg[gate] = 0.0f;
      } else {
        key_head_grad[head_grad] += d_key[t];
        dgamma[gate] = d_gamma[t];
        dg[gate] = gammas[t] * d_gamma[t];
      }
    }
  }
  // Every channel's dbeta terms are in device memory before the tokens'
  // sums read them.
  threadgroup_barrier(mem_flags::mem_device);
  if (tid < length) {
    const uint t = start + tid;
    float sum = 0.0f;
    for (uint column = 0; column < p.key_dim; ++column) {
      sum += decay_entry_terms[(rows + tid) * p.key_dim + column];
    }
    const uint gate = gate_offset(p, b, t, h);
    dbeta[gate] = token_is_masked(p, mask, b, t) ? 0.0f : dbeta[gate] + sum;
  }
}

instantiate_kernel("gated_delta_channel_pairs_backward_float32", gated_delta_channel_pairs_backward, float)
instantiate_kernel("gated_delta_channel_pairs_backward_float16", gated_delta_channel_pairs_backward, half)
instantiate_kernel("gated_delta_channel_pairs_backward_bfloat16", gated_delta_channel_pairs_backward, bfloat)
