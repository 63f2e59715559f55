// recompute_w_u_backward: the gradient of U = T Vb and W = T Kb (Vb =
// diag(beta) V, Kb = diag(beta Gamma) K, Gamma_i = decay(i, -1)), for every
// chunk at once, from dU = dV' and dW (chunk_output_backward and
// chunk_carry_backward):
//
//   dT = dU Vb^T + dW Kb^T (lower, with the diagonal)
//   dVb = T^T dU;  dKb = T^T dW;  dv = beta dVb;  dk += beta Gamma dKb
//   dbeta = dVb . v + Gamma dKb . k
//
// and adds Gamma_i's gradient without it, beta_i dKb_i . k_i, to the entry
// terms of gate_cumsum_backward. dT goes to kkt_inverse_backward. It writes
// dv and starts dbeta. Chunks with a decay that is not a normal float are
// left to the recurrent reverse.
//
// Per-key gates (p.per_key_gates): Kb_ic = beta_i Gamma_ic k_ic, Gamma per
// key channel, so dk += beta Gamma o dKb, dbeta gains (Gamma o dKb) . k,
// and the entry terms, [L, Dk], gain beta_i dKb_ic k_ic per channel.
//
// One threadgroup of kChunkThreads per (chunk, value head, batch); T is staged
// in threadgroup memory, and four threads share each token row
// (kWuLanesPerRow), whose dot products meet in threadgroup memory.

#include "backward_common.h"

GATED_DELTA_ABI_CONSTANT uint kWuLanesPerRow = kChunkThreads / kChunkSize;

template <typename T>
[[kernel]] void gated_delta_recompute_w_u_backward(
    const device T* k [[buffer(0)]],
    const device T* v [[buffer(1)]],
    const device ulong* tiny_decay_mask [[buffer(2)]],
    const device float* key_inverse_norm [[buffer(4)]],
    const device float* gate_cumsum [[buffer(5)]],
    const device float* beta_effective [[buffer(6)]],
    const device float* kkt_inverse [[buffer(7)]],
    const device float* d_corrected [[buffer(8)]],
    const device float* dw [[buffer(9)]],
    device float* dt [[buffer(10)]],
    device float* decay_entry_terms [[buffer(11)]],
    device float* key_head_grad [[buffer(12)]],
    device T* dv [[buffer(13)]],
    device float* dbeta [[buffer(14)]],
    constant GatedDeltaKernelParams& p [[buffer(15)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float t_tile[kChunkSize * kChunkSize];
  threadgroup float value_terms[kChunkThreads];
  threadgroup float key_terms[kChunkThreads];
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
  const device float* cumsum = gate_cumsum + rows * gate_width(p);
  const device float* beta = beta_effective + rows;

  for (uint e = tid; e < kChunkSize * kChunkSize; e += kChunkThreads) {
    t_tile[e] = kkt_inverse[rows * kChunkSize + e];
  }
  for (uint e = tid; e < kChunkSize * kChunkSize; e += kChunkThreads) {
    const uint i = e / kChunkSize;
    const uint j = e % kChunkSize;
    float sum = 0.0f;
    if (j <= i && i < length) {
      const uint values = v_offset(p, b, start + j, h);
      for (uint c = 0; c < p.value_dim; ++c) {
        sum += d_corrected[(rows + i) * p.value_dim + c] * float(v[values + c]);
      }
      sum *= beta[j];
      // dW_i . Kb_j / beta_j: Gamma_j after the sum, or per channel inside it.
      float key_sum = 0.0f;
      for (uint c = 0; c < p.key_dim; ++c) {
        const float decay = per_key ? exp(chunk_log_decay(p, cumsum, j, c)) : 1.0f;
        key_sum += dw[(rows + i) * p.key_dim + c] * decay *
                   normalized_key(k, key_inverse_norm, p, b, start + j, kh, c);
      }
      sum += beta[j] * (per_key ? 1.0f : exp(cumsum[j])) * key_sum;
    }
    dt[rows * kChunkSize + e] = sum;
  }
  // T is staged before the products read it.
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const uint row = tid / kWuLanesPerRow;
  const uint lane = tid % kWuLanesPerRow;
  float value_term = 0.0f, key_term = 0.0f;
  if (row < length) {
    const uint t = start + row;
    const uint values = v_offset(p, b, t, h);
    for (uint c = lane; c < p.value_dim; c += kWuLanesPerRow) {
      float sum = 0.0f;  // dVb
      for (uint m = row; m < length; ++m) {
        sum += t_tile[m * kChunkSize + row] * d_corrected[(rows + m) * p.value_dim + c];
      }
      dv[values + c] = static_cast<T>(beta[row] * sum);
      value_term += sum * float(v[values + c]);
    }
    const uint head_grad = ((b * p.tokens + t) * p.value_heads + h) * p.key_dim;
    for (uint c = lane; c < p.key_dim; c += kWuLanesPerRow) {
      float sum = 0.0f;  // dKb
      for (uint m = row; m < length; ++m) {
        sum += t_tile[m * kChunkSize + row] * dw[(rows + m) * p.key_dim + c];
      }
      const float decay_from_start = exp(chunk_log_decay(p, cumsum, row, c));
      const float key = normalized_key(k, key_inverse_norm, p, b, t, kh, c);
      key_head_grad[head_grad + c] += beta[row] * decay_from_start * sum;
      if (per_key) {
        key_term += decay_from_start * sum * key;
        decay_entry_terms[(rows + row) * p.key_dim + c] += beta[row] * sum * key;
      } else {
        key_term += sum * key;
      }
    }
  }
  value_terms[tid] = value_term;
  key_terms[tid] = key_term;
  // Every row's partial sums are in place before they are added up.
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < length) {
    float value_sum = 0.0f, key_sum = 0.0f;
    for (uint l = 0; l < kWuLanesPerRow; ++l) {
      value_sum += value_terms[tid * kWuLanesPerRow + l];
      key_sum += key_terms[tid * kWuLanesPerRow + l];
    }
    if (per_key) {
      dbeta[gate_offset(p, b, start + tid, h)] = value_sum + key_sum;
    } else {
      const float decay_from_start = exp(cumsum[tid]);
      dbeta[gate_offset(p, b, start + tid, h)] = value_sum + decay_from_start * key_sum;
      decay_entry_terms[rows + tid] += beta[tid] * key_sum;
    }
  }
}

instantiate_kernel("gated_delta_recompute_w_u_backward_float32", gated_delta_recompute_w_u_backward, float)
instantiate_kernel("gated_delta_recompute_w_u_backward_float16", gated_delta_recompute_w_u_backward, half)
instantiate_kernel("gated_delta_recompute_w_u_backward_bfloat16", gated_delta_recompute_w_u_backward, bfloat)
