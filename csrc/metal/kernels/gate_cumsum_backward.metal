// gate_cumsum_backward: the gradient of the decays, for every chunk at once.
// Every decay the other WY stages read is decay(i, j) = prod_{j < s <= i}
// gamma_s (j = -1: from the chunk's start), gamma = exp(g), and they left
// its gradient without it, P_ij: the pair terms (j < i; the exit state's
// decay(L-1, j) in row L-1) and the entry terms P_{i,-1}. So
//
//   dgamma_t = sum_{i >= t > j} P_ij decay(i, t) decay(t-1, j),  dg_t = gamma_t dgamma_t
//
// as two scans of the chunk (csrc/cpu/chunked_backward_stages.h,
// decay_gradient, the same sum): a thread per row i carries
// H_it = sum_{j < t} P_ij decay(t-1, j) (H_i0 = P_{i,-1},
// H_{i,t+1} = gamma_t H_it + P_it), then a thread per token t sums
// decay(i, t) H_it over i >= t. The decays are running products of gamma:
// every term is formed without gamma_t, so a tiny gamma_t costs no
// precision (dg summed over the tokens and divided by a tiny gamma would
// be the rounding of terms far larger than itself). Masked tokens decay by 1
// (as gate_cumsum takes them) and get exactly zero dq, dk (per value head),
// dg, dgamma and dbeta. Chunks with a decay that is not a normal float are
// left to the recurrent reverse (which writes their rows itself).
//
// One threadgroup of kChunkSize threads per (chunk, value head, batch); the
// pair terms (then H) and the gammas are staged in threadgroup memory.

#include "backward_common.h"

[[kernel]] void gated_delta_gate_cumsum_backward(
    const device float* g [[buffer(0)]],
    const device bool* mask [[buffer(1)]],
    const device float* decay_entry_terms [[buffer(2)]],
    const device float* decay_pair_terms [[buffer(3)]],
    device float* dg [[buffer(4)]],
    device float* dgamma [[buffer(5)]],
    device float* dbeta [[buffer(6)]],
    device float* query_head_grad [[buffer(7)]],
    device float* key_head_grad [[buffer(8)]],
    constant GatedDeltaKernelParams& p [[buffer(9)]],
    const device ulong* tiny_decay_mask [[buffer(10)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float carried[kChunkSize * kChunkSize];  // P_it, then H_it
  threadgroup float gammas[kChunkSize];
  const uint chunk = group.x;
  const uint h = group.y;
  const uint b = group.z;
  if (!chunk_decays_normal(tiny_decay_mask, p, b, h, chunk)) {
    return;
  }
  const uint length = chunk_length(p, chunk);
  const uint start = chunk * kChunkSize;
  const uint rows = chunk_row(p, b, h, p.value_heads, chunk);
  const bool masked = tid < length && token_is_masked(p, mask, b, start + tid);
  for (uint e = tid; e < kChunkSize * kChunkSize; e += kChunkSize) {
    carried[e] = decay_pair_terms[rows * kChunkSize + e];
  }
  if (tid < length) {
    gammas[tid] = masked ? 1.0f : exp(g[gate_offset(p, b, start + tid, h)]);
  }
  // The pair terms and every gamma are staged before the rows scan them.
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < length) {
    const uint i = tid;
    float sum = decay_entry_terms[rows + i];
    for (uint t = 0; t < i; ++t) {
      const float pair = carried[i * kChunkSize + t];
      carried[i * kChunkSize + t] = sum;
      sum = gammas[t] * sum + pair;
    }
    carried[i * kChunkSize + i] = sum;
  }
  // Every row's H is in place before the tokens' sums read its columns.
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < length) {
    const uint t = tid;
    float d_decay = carried[t * kChunkSize + t];
    float running = 1.0f;  // decay(i, t)
    for (uint i = t + 1; i < length; ++i) {
      running *= gammas[i];
      d_decay += running * carried[i * kChunkSize + t];
    }
    const uint gate = gate_offset(p, b, start + t, h);
    dgamma[gate] = masked ? 0.0f : d_decay;
    dg[gate] = masked ? 0.0f : gammas[t] * d_decay;
  }
  if (masked) {
    dbeta[gate_offset(p, b, start + tid, h)] = 0.0f;
    const uint head_grad = ((b * p.tokens + start + tid) * p.value_heads + h) * p.key_dim;
    for (uint c = 0; c < p.key_dim; ++c) {
      query_head_grad[head_grad + c] = 0.0f;
      key_head_grad[head_grad + c] = 0.0f;
    }
  }
}
