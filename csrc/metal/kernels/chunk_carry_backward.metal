// chunk_carry_backward, once per chunk from the last to the first (the plan's
// dispatch says which), carrying dS (dstate): the gradient of chunk_carry's
// entry-state share of the output, of the exit state and of V' = U - W S0^T.
// With S0 the state entering the chunk (boundary_states), Gamma_i =
// decay(i, -1), e_j = decay(L-1, j) and dO = scale dy:
//
//   dq_i += Gamma_i S0^T dO_i;  dV'_j += e_j dS k_j;  dk_j += e_j dS^T V'_j
//   dW = -dV' S0
//   dS0 = Gamma_{L-1} dS + sum_i Gamma_i dO_i q_i^T - sum_j dV'_j W_j^T
//
// and the gradients of its decays without them, for gate_cumsum_backward:
// Gamma_i's entry term (S0^T dO_i) . q_i (plus <dS, S0> at i = L-1), which
// it writes first, and e_j's (dS^T V'_j) . k_j (j < L-1), added to the pair
// terms' row L-1 (e_j = decay(L-1, j)). dS0 replaces dS in dstate. Chunks
// with a decay that is not a normal float are left to the recurrent reverse
// (chunk_decays_normal).
//
// Per-key gates (p.per_key_gates): Gamma and e are per key channel, so
// they scale the channels inside the products (dq += Gamma o (S0^T dO), dk
// += e o (dS^T V'), dV'_j += dS (e_j o k_j), dS0 = dS diag(Gamma_{L-1}) +
// ...), and the decays' gradients are per channel too: the entry terms
// (S0^T dO_i) o q_i (plus <dS[:, c], S0[:, c]> at i = L-1) and the exit
// terms (dS^T V'_j) o k_j, [L, Dk] each, for channel_pairs_backward.
//
// One threadgroup of kChunkThreads per (value head, batch) owns that head's
// dS; four threads share each token row (kCarryLanesPerRow), whose dot
// products' partial sums meet in threadgroup memory.

#include "backward_common.h"

GATED_DELTA_ABI_CONSTANT uint kCarryLanesPerRow = kChunkThreads / kChunkSize;

template <typename T>
[[kernel]] void gated_delta_chunk_carry_backward(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device ulong* tiny_decay_mask [[buffer(2)]],
    const device bool* mask [[buffer(3)]],
    const device float* query_inverse_norm [[buffer(4)]],
    const device float* key_inverse_norm [[buffer(5)]],
    const device float* gate_cumsum [[buffer(6)]],
    const device float* w [[buffer(7)]],
    const device float* corrected [[buffer(8)]],
    const device float* boundary_states [[buffer(9)]],
    const device T* y_cotangent [[buffer(10)]],
    device float* dstate [[buffer(11)]],
    device float* d_corrected [[buffer(12)]],
    device float* dw [[buffer(13)]],
    device float* decay_entry_terms [[buffer(14)]],
    device float* decay_pair_terms [[buffer(15)]],
    device float* query_head_grad [[buffer(16)]],
    device float* key_head_grad [[buffer(17)]],
    constant GatedDeltaKernelParams& p [[buffer(18)]],
    constant uint& chunk [[buffer(19)]],
    device float* decay_exit_terms [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float query_terms[kChunkThreads];
  threadgroup float key_terms[kChunkThreads];
  threadgroup float entry_terms[kChunkThreads];
  const uint h = group.x;
  const uint b = group.y;
  if (!chunk_decays_normal(tiny_decay_mask, p, b, h, chunk)) {
    return;
  }
  const uint kh = key_head_of(p, h);
  const uint length = chunk_length(p, chunk);
  const uint start = chunk * kChunkSize;
  const uint rows = chunk_row(p, b, h, p.value_heads, chunk);
  const bool per_key = p.per_key_gates != 0;
  const device float* cumsum = gate_cumsum + rows * gate_width(p);
  const device float* entry = boundary_states + state_stack_row(p, b, h, p.num_chunks, chunk, 0);
  device float* ds = dstate + state_row_offset(p, b, h, 0);
  const uint row = tid / kCarryLanesPerRow;
  const uint lane = tid % kCarryLanesPerRow;

  // Token `row`'s share of the dS-side products (four threads per row).
  float query_term = 0.0f, key_term = 0.0f;
  if (row < length) {
    const uint t = start + row;
    const bool active = !token_is_masked(p, mask, b, t);
    // decay(L-1, row) of the head (scalar gates), applied after the sum.
    const float head_to_end =
        per_key ? 1.0f : exp(cumsum[length - 1] - cumsum[row]);
    const uint dy_row = v_offset(p, b, t, h);
    const uint head_grad = ((b * p.tokens + t) * p.value_heads + h) * p.key_dim;
    for (uint r = lane; r < p.value_dim; r += kCarryLanesPerRow) {
      float sum = 0.0f;
      for (uint c = 0; c < p.key_dim; ++c) {
        float key = normalized_key(k, key_inverse_norm, p, b, t, kh, c);
        if (per_key) {
          key *= exp(chunk_log_decay(p, cumsum, length - 1, c) - chunk_log_decay(p, cumsum, row, c));
        }
        sum += ds[r * p.key_dim + c] * key;
      }
      d_corrected[(rows + row) * p.value_dim + r] += head_to_end * sum;
    }
    for (uint c = lane; c < p.key_dim; c += kCarryLanesPerRow) {
      float out_state = 0.0f;  // (S0^T dO)_c
      float back = 0.0f;  // (dS^T V')_c
      for (uint r = 0; r < p.value_dim; ++r) {
        const float d_out = active ? p.scale * float(y_cotangent[dy_row + r]) : 0.0f;
        out_state += d_out * entry[r * p.key_dim + c];
        back += ds[r * p.key_dim + c] * corrected[(rows + row) * p.value_dim + r];
      }
      const float log_from_start = chunk_log_decay(p, cumsum, row, c);
      const float to_end = exp(chunk_log_decay(p, cumsum, length - 1, c) - log_from_start);
      query_head_grad[head_grad + c] += exp(log_from_start) * out_state;
      key_head_grad[head_grad + c] += to_end * back;
      const float query_share = out_state * normalized_key(q, query_inverse_norm, p, b, t, kh, c);
      const float key_share = back * normalized_key(k, key_inverse_norm, p, b, t, kh, c);
      if (per_key) {
        decay_entry_terms[(rows + row) * p.key_dim + c] = query_share;
        decay_exit_terms[(rows + row) * p.key_dim + c] = key_share;
      } else {
        query_term += query_share;
        key_term += key_share;
      }
    }
  }
  query_terms[tid] = query_term;
  key_terms[tid] = key_term;
  // <dS, S0>, the gradient of Gamma_{L-1}, which decays S0 into the exit
  // state: this thread's share of it, or with per-key gates channel tid's
  // whole (kMaxChunkedKeyDim <= kChunkThreads).
  float entry_term = 0.0f;
  if (per_key) {
    for (uint r = 0; r < p.value_dim && tid < p.key_dim; ++r) {
      entry_term += ds[r * p.key_dim + tid] * entry[r * p.key_dim + tid];
    }
  } else {
    for (uint e = tid; e < p.value_dim * p.key_dim; e += kChunkThreads) {
      entry_term += ds[e] * entry[e];
    }
  }
  entry_terms[tid] = entry_term;
  // dV' is complete in device memory and every partial sum is in place; all
  // reads of dS are done before it is overwritten with dS0 below.
  threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);

  if (per_key) {
    if (tid < p.key_dim) {
      decay_entry_terms[(rows + length - 1) * p.key_dim + tid] += entry_term;
    }
  } else if (tid < length) {
    float q_sum = 0.0f, k_sum = 0.0f;
    for (uint l = 0; l < kCarryLanesPerRow; ++l) {
      q_sum += query_terms[tid * kCarryLanesPerRow + l];
      k_sum += key_terms[tid * kCarryLanesPerRow + l];
    }
    if (tid == length - 1) {
      for (uint m = 0; m < kChunkThreads; ++m) {
        q_sum += entry_terms[m];
      }
    } else {
      decay_pair_terms[(rows + length - 1) * kChunkSize + tid] += k_sum;
    }
    decay_entry_terms[rows + tid] = q_sum;
  }
  for (uint e = tid; e < length * p.key_dim; e += kChunkThreads) {
    const uint i = e / p.key_dim;
    const uint c = e % p.key_dim;
    float sum = 0.0f;
    for (uint r = 0; r < p.value_dim; ++r) {
      sum += d_corrected[(rows + i) * p.value_dim + r] * entry[r * p.key_dim + c];
    }
    dw[(rows + i) * p.key_dim + c] = -sum;
  }
  for (uint e = tid; e < p.value_dim * p.key_dim; e += kChunkThreads) {
    const uint r = e / p.key_dim;
    const uint c = e % p.key_dim;
    float sum = exp(chunk_log_decay(p, cumsum, length - 1, c)) * ds[e];
    for (uint i = 0; i < length; ++i) {
      const uint t = start + i;
      if (!token_is_masked(p, mask, b, t)) {
        sum += exp(chunk_log_decay(p, cumsum, i, c)) * p.scale * float(y_cotangent[v_offset(p, b, t, h) + r]) *
               normalized_key(q, query_inverse_norm, p, b, t, kh, c);
      }
      sum -= d_corrected[(rows + i) * p.value_dim + r] * w[(rows + i) * p.key_dim + c];
    }
    ds[e] = sum;
  }
}

instantiate_kernel("gated_delta_chunk_carry_backward_float32", gated_delta_chunk_carry_backward, float)
instantiate_kernel("gated_delta_chunk_carry_backward_float16", gated_delta_chunk_carry_backward, half)
instantiate_kernel("gated_delta_chunk_carry_backward_bfloat16", gated_delta_chunk_carry_backward, bfloat)
