// gate_cumsum_backward: the gradient of gate_cumsum's in-chunk cumulative sum,
// for every chunk at once: dg_t = sum_{i >= t} dG_i (a reverse cumulative
// sum of d_log, which the other WY stages filled), and the linear decay's
// gradient dg_t / exp(g_t). Masked tokens get exactly zero dq, dk (per value
// head), dg, dgamma and dbeta. Chunks with a decay that is not a normal
// float are left to the recurrent reverse (which writes their rows itself).
//
// One threadgroup of kChunkSize threads per (chunk, value head, batch): the
// first thread scans, then each thread clears its masked token's rows.

#include "backward_common.h"

[[kernel]] void gated_delta_gate_cumsum_backward(
    const device float* g [[buffer(0)]],
    const device bool* mask [[buffer(1)]],
    const device float* d_log [[buffer(2)]],
    device float* dg [[buffer(3)]],
    device float* dgamma [[buffer(4)]],
    device float* dbeta [[buffer(5)]],
    device float* query_head_grad [[buffer(6)]],
    device float* key_head_grad [[buffer(7)]],
    constant GatedDeltaKernelParams& p [[buffer(8)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  const uint chunk = group.x;
  const uint h = group.y;
  const uint b = group.z;
  if (!chunk_decays_normal(g, mask, p, b, h, chunk)) {
    return;
  }
  const uint length = chunk_length(p, chunk);
  const uint start = chunk * kChunkSize;
  const uint rows = chunk_row(p, b, h, p.value_heads, chunk);
  if (tid == 0) {
    float suffix = 0.0f;
    for (uint i = length; i-- > 0;) {
      suffix += d_log[rows + i];
      const uint gate = gate_offset(p, b, start + i, h);
      const bool masked = token_is_masked(p, mask, b, start + i);
      dg[gate] = masked ? 0.0f : suffix;
      dgamma[gate] = masked ? 0.0f : suffix / exp(g[gate]);
    }
  }
  if (tid < length && token_is_masked(p, mask, b, start + tid)) {
    dbeta[gate_offset(p, b, start + tid, h)] = 0.0f;
    const uint head_grad = ((b * p.tokens + start + tid) * p.value_heads + h) * p.key_dim;
    for (uint c = 0; c < p.key_dim; ++c) {
      query_head_grad[head_grad + c] = 0.0f;
      key_head_grad[head_grad + c] = 0.0f;
    }
  }
}
