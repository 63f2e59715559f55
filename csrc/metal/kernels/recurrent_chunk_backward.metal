// recurrent_chunk_backward, once per chunk from the last to the first (the plan's
// dispatch says which), right after chunk_states of that chunk: the reverse
// of the chunk's tokens, last first, carrying dS (dstate) backward. Per
// active token, with a = exp(g), S_prev the state before the token
// (chunk_states), Sd = a S_prev, p = Sd k, d = beta (v - p), S = Sd + d k^T:
//
//   dS += scale dy q^T;          dq = scale S^T dy
//   dd = dS k;  dp = -beta dd;   dv = beta dd;   dbeta = dd . (v - p)
//   dk = dS^T d + a (S_prev^T dp)
//   dSd = dS + dp k^T;  da = <dSd, S_prev>;  dg = a da;  dS_prev = a dSd
//
// (per-key gates: a per column, da per column). dg = a da is exactly 0 at a
// wipe (a = 0). The rows of S are formed again from S_prev (a S_prev + d k^T,
// the forward's own float32 arithmetic), which spares storing and reading the
// state after each token; dq is never formed as a (S_prev^T dy) + k (dy . d),
// whose terms cancel where the delta rule overwrites the state (beta near 1).
// A masked token passes dS through and gets zero gradients.
//
// One threadgroup per (batch, value head) over every state row: SIMD-group s
// takes rows s, s + kBackwardSimdGroups, ...; a row's dot products are
// SIMD-group sums, and the sums over rows (dq, dk, da, dbeta) go through
// per-SIMD-group partial sums in threadgroup memory. dq and dk are written per
// value head, float32 (qk_grad_reduce sums them over the value heads).

#include "backward_common.h"

template <typename T>
[[kernel]] void gated_delta_recurrent_chunk_backward(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device T* v [[buffer(2)]],
    const device float* g [[buffer(3)]],
    const device float* beta [[buffer(4)]],
    const device bool* mask [[buffer(5)]],
    const device T* y_cotangent [[buffer(6)]],
    const device float* chunk_states [[buffer(7)]],
    device float* dstate [[buffer(8)]],
    device float* query_head_grad [[buffer(9)]],
    device float* key_head_grad [[buffer(10)]],
    device T* dv [[buffer(11)]],
    device float* dg [[buffer(12)]],
    device float* dgamma [[buffer(13)]],
    device float* dbeta [[buffer(14)]],
    constant GatedDeltaKernelParams& p [[buffer(15)]],
    constant uint& chunk [[buffer(16)]],
    const device ulong* tiny_decay_mask [[buffer(17)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float partial_dq[kBackwardSimdGroups * kMaxBackwardKeyDim];
  threadgroup float partial_dk[kBackwardSimdGroups * kMaxBackwardKeyDim];
  threadgroup float partial_da[kBackwardSimdGroups * kMaxBackwardKeyDim];
  // Per SIMD-group: dbeta and da (one decay per head).
  threadgroup float partial_scalars[2 * kBackwardSimdGroups];

  const uint h = group.x;
  const uint b = group.y;
  // The chunked backward's WY stages take this chunk (uniform across the
  // threadgroup).
  if (p.recurrent_wipe_chunks_only != 0 && chunk_decays_normal(tiny_decay_mask, p, b, h, chunk)) {
    return;
  }
  const uint kh = key_head_of(p, h);
  const bool per_key = p.per_key_gates != 0;
  const uint start = chunk * kChunkSize;
  for (uint i = chunk_length(p, chunk); i-- > 0;) {
    const uint t = start + i;
    const uint gate = gate_offset(p, b, t, h);
    const uint head_grad = ((b * p.tokens + t) * p.value_heads + h) * p.key_dim;
    const uint values = v_offset(p, b, t, h);
    // The mask is uniform across the threadgroup, so are the barriers below.
    if (token_is_masked(p, mask, b, t)) {
      for (uint c = tid; c < p.key_dim; c += kBackwardThreads) {
        query_head_grad[head_grad + c] = 0.0f;
        key_head_grad[head_grad + c] = 0.0f;
        if (per_key) {
          dg[key_gate_offset(p, gate, c)] = 0.0f;
          dgamma[key_gate_offset(p, gate, c)] = 0.0f;
        }
      }
      for (uint r = tid; r < p.value_dim; r += kBackwardThreads) {
        dv[values + r] = static_cast<T>(0.0f);
      }
      if (tid == 0) {
        dbeta[gate] = 0.0f;
        if (!per_key) {
          dg[gate] = 0.0f;
          dgamma[gate] = 0.0f;
        }
      }
      continue;
    }
    float q_lanes[kBackwardColumnsPerLane];
    float k_lanes[kBackwardColumnsPerLane];
    float decays[kBackwardColumnsPerLane];
    load_key_lanes(q, qk_offset(p, b, t, kh), p, lane, q_lanes);
    load_key_lanes(k, qk_offset(p, b, t, kh), p, lane, k_lanes);
    load_decay_lanes(g, gate, p, lane, decays);
    const float beta_t = beta[gate];

    float dq_acc[kBackwardColumnsPerLane];
    float dk_acc[kBackwardColumnsPerLane];
    float da_acc[kBackwardColumnsPerLane];
    for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
      dq_acc[m] = 0.0f;
      dk_acc[m] = 0.0f;
      da_acc[m] = 0.0f;
    }
    float dbeta_acc = 0.0f;
    for (uint r = simd_index; r < p.value_dim; r += kBackwardSimdGroups) {
      const device float* previous = chunk_states + state_stack_row(p, b, h, kChunkSize, i, r);
      device float* ds = dstate + state_row_offset(p, b, h, r);
      const float dy_scaled = p.scale * float(y_cotangent[values + r]);
      // Pass 1: dS += scale dy q^T; dd = dS k; p = Sd k.
      float dd = 0.0f;
      float prediction = 0.0f;
      for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
        const uint c = lane + 32 * m;
        if (c < p.key_dim) {
          const float ds_c = ds[c] + dy_scaled * q_lanes[m];
          ds[c] = ds_c;
          dd += ds_c * k_lanes[m];
          prediction += decays[m] * previous[c] * k_lanes[m];
        }
      }
      dd = simd_sum(dd);
      prediction = simd_sum(prediction);
      const float residual = float(v[values + r]) - prediction;
      const float delta = beta_t * residual;
      const float dp = -beta_t * dd;
      if (lane == 0) {
        dv[values + r] = static_cast<T>(beta_t * dd);
      }
      dbeta_acc += dd * residual;
      // Pass 2: dq += scale dy_r S_r; dk += d dS + a dp S_prev; dSd = dS + dp k;
      // da += dSd S_prev; dS_prev = a dSd.
      for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
        const uint c = lane + 32 * m;
        if (c < p.key_dim) {
          const float ds_c = ds[c];
          dq_acc[m] += dy_scaled * (decays[m] * previous[c] + delta * k_lanes[m]);
          dk_acc[m] += delta * ds_c + decays[m] * dp * previous[c];
          const float dsd = ds_c + dp * k_lanes[m];
          da_acc[m] += dsd * previous[c];
          ds[c] = decays[m] * dsd;
        }
      }
    }
    float da_head = 0.0f;
    for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
      da_head += da_acc[m];
    }
    da_head = simd_sum(da_head);

    // Every thread is done reading the previous token's partial sums.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
      const uint c = lane + 32 * m;
      partial_dq[simd_index * kMaxBackwardKeyDim + c] = dq_acc[m];
      partial_dk[simd_index * kMaxBackwardKeyDim + c] = dk_acc[m];
      partial_da[simd_index * kMaxBackwardKeyDim + c] = da_acc[m];
    }
    if (lane == 0) {
      partial_scalars[simd_index] = dbeta_acc;
      partial_scalars[kBackwardSimdGroups + simd_index] = da_head;
    }
    // Every SIMD-group's partial sums are written before any thread adds them.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Thread tid reduces key column tid (kBackwardThreads == kMaxBackwardKeyDim,
    // checked in plan/backward.cpp): the column its own lane holds at m = simd_index,
    // as tid = 32 simd_index + lane.
    if (tid < p.key_dim) {
      float dq_sum = 0.0f;
      float dk_sum = 0.0f;
      float dgamma_sum = 0.0f;
      for (uint s = 0; s < kBackwardSimdGroups; ++s) {
        dq_sum += partial_dq[s * kMaxBackwardKeyDim + tid];
        dk_sum += partial_dk[s * kMaxBackwardKeyDim + tid];
        dgamma_sum += partial_da[s * kMaxBackwardKeyDim + tid];
      }
      query_head_grad[head_grad + tid] = dq_sum;
      key_head_grad[head_grad + tid] = dk_sum;
      if (per_key) {
        dgamma[key_gate_offset(p, gate, tid)] = dgamma_sum;
        // Exactly 0 at a wipe.
        dg[key_gate_offset(p, gate, tid)] = decays[simd_index] * dgamma_sum;
      }
    }
    if (tid == 0) {
      float dbeta_sum = 0.0f;
      float dgamma_sum = 0.0f;
      for (uint s = 0; s < kBackwardSimdGroups; ++s) {
        dbeta_sum += partial_scalars[s];
        dgamma_sum += partial_scalars[kBackwardSimdGroups + s];
      }
      dbeta[gate] = dbeta_sum;
      if (!per_key) {
        dgamma[gate] = dgamma_sum;
        dg[gate] = decays[0] * dgamma_sum;  // exactly 0 at a wipe
      }
    }
  }
}

instantiate_kernel("gated_delta_recurrent_chunk_backward_float32", gated_delta_recurrent_chunk_backward, float)
instantiate_kernel("gated_delta_recurrent_chunk_backward_float16", gated_delta_recurrent_chunk_backward, half)
instantiate_kernel("gated_delta_recurrent_chunk_backward_bfloat16", gated_delta_recurrent_chunk_backward, bfloat)
