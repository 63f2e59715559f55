// The recurrent gated-delta kernels (decode and short prefill): the recurrence
// of docs/contract.md, token by token, for one slice of state rows.
//
//   S <- exp(g) S;  d = beta (v - S k);  S += d k^T;  y = scale S q
//
// With per-key gates (p.per_key_gates) column c of S decays by exp(g[c]).
//
// Rows of S (value dims) evolve independently, so each threadgroup owns a
// slice of rows of one (batch, value head) and walks all tokens. With
// checkpoints, its rows of S are copied out after each checkpoint's token
// (masked or not). For tree verification, token t starts from token
// parents[t]'s rows (state_in for -1), and every token's rows are kept in
// tree_states for its children; each thread reads back only what it wrote.

#include "gated_delta_common.h"

// Key dims a multiple of 32 and at most 128 (supports_simd_delta): one
// SIMD-group per state row, the row held in registers, kSimdStatePerLane
// entries per lane; the dot products are SIMD-group sums.
template <typename T>
[[kernel]] void gated_delta_recurrent_simd(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device T* v [[buffer(2)]],
    const device float* g [[buffer(3)]],
    const device float* beta [[buffer(4)]],
    const device bool* mask [[buffer(5)]],
    const device float* state_in [[buffer(6)]],
    device float* state_out [[buffer(7)]],
    device T* y [[buffer(8)]],
    constant GatedDeltaKernelParams& p [[buffer(9)]],
    const device int* checkpoints [[buffer(10)]],
    device float* checkpoint_states [[buffer(11)]],
    const device int* parents [[buffer(12)]],
    device float* tree_states [[buffer(13)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint row = group.x * kRecurrentSimdRows + simd_index;
  const uint h = group.y;
  const uint b = group.z;
  // Uniform across the SIMD-group: a whole SIMD-group past the last row leaves.
  if (row >= p.value_dim) {
    return;
  }
  const uint kh = key_head_of(p, h);
  const uint per_lane = p.key_dim / 32;
  const uint state_row = ((b * p.value_heads + h) * p.value_dim + row) * p.key_dim;

  float s[kSimdStatePerLane];
  for (uint m = 0; m < kSimdStatePerLane; ++m) {
    s[m] = m < per_lane ? state_in[state_row + lane + 32 * m] : 0.0f;
  }
  uint next_checkpoint = 0;
  for (uint t = 0; t < p.tokens; ++t) {
    const uint out = v_offset(p, b, t, h) + row;
    if (p.has_tree != 0) {
      const int parent = parents[t];
      for (uint m = 0; m < per_lane; ++m) {
        s[m] = parent < 0 ? state_in[state_row + lane + 32 * m]
                          : tree_states[tree_state_row(p, b, h, uint(parent), row) + lane + 32 * m];
      }
    }
    if (token_is_masked(p, mask, b, t)) {
      if (lane == 0) {
        y[out] = static_cast<T>(0.0f);
      }
    } else {
      const uint qk = qk_offset(p, b, t, kh);
      float k_lane[kSimdStatePerLane];
      float q_lane[kSimdStatePerLane];
      float k_squares = 0.0f;
      float q_squares = 0.0f;
      for (uint m = 0; m < kSimdStatePerLane; ++m) {
        k_lane[m] = m < per_lane ? float(k[qk + lane + 32 * m]) : 0.0f;
        q_lane[m] = m < per_lane ? float(q[qk + lane + 32 * m]) : 0.0f;
        k_squares += k_lane[m] * k_lane[m];
        q_squares += q_lane[m] * q_lane[m];
      }
      k_squares = simd_sum(k_squares);
      q_squares = simd_sum(q_squares);
      const float k_scale = p.normalize_qk != 0 ? 1.0f / sqrt(k_squares + 1e-6f) : 1.0f;
      const float q_scale = p.normalize_qk != 0 ? 1.0f / sqrt(q_squares + 1e-6f) : 1.0f;

      const uint gate = gate_offset(p, b, t, h);
      const bool per_key = p.per_key_gates != 0;
      const float decay = per_key ? 1.0f : exp(g[gate]);
      float prediction = 0.0f;
      for (uint m = 0; m < kSimdStatePerLane; ++m) {
        // Per-key gates: this lane's column lane + 32 m has its own decay.
        const bool column = m < per_lane;
        s[m] *= per_key ? (column ? exp(g[key_gate_offset(p, gate, lane + 32 * m)]) : 0.0f)
                        : decay;
        prediction += s[m] * k_lane[m];
      }
      prediction = simd_sum(prediction) * k_scale;
      const float delta = beta[gate] * (float(v[out]) - prediction);
      float readout = 0.0f;
      for (uint m = 0; m < kSimdStatePerLane; ++m) {
        s[m] += delta * k_lane[m] * k_scale;
        readout += s[m] * q_lane[m];
      }
      readout = simd_sum(readout) * q_scale * p.scale;
      if (lane == 0) {
        y[out] = static_cast<T>(readout);
      }
    }
    if (p.has_tree != 0) {
      for (uint m = 0; m < per_lane; ++m) {
        tree_states[tree_state_row(p, b, h, t, row) + lane + 32 * m] = s[m];
      }
    }
    if (checkpoint_at(p, checkpoints, next_checkpoint, t + 1)) {
      const uint slot = checkpoint_offset(p, next_checkpoint) + state_row;
      for (uint m = 0; m < per_lane; ++m) {
        checkpoint_states[slot + lane + 32 * m] = s[m];
      }
      ++next_checkpoint;
    }
  }
  for (uint m = 0; m < per_lane; ++m) {
    state_out[state_row + lane + 32 * m] = s[m];
  }
}

// Any key dim up to kMaxGenericKeyDim: one thread per state row, the row kept
// in state_out (copied from state_in first), the token's q and k staged in
// threadgroup memory for every row of the threadgroup to read.
template <typename T>
[[kernel]] void gated_delta_recurrent_generic(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device T* v [[buffer(2)]],
    const device float* g [[buffer(3)]],
    const device float* beta [[buffer(4)]],
    const device bool* mask [[buffer(5)]],
    const device float* state_in [[buffer(6)]],
    device float* state_out [[buffer(7)]],
    device T* y [[buffer(8)]],
    constant GatedDeltaKernelParams& p [[buffer(9)]],
    const device int* checkpoints [[buffer(10)]],
    device float* checkpoint_states [[buffer(11)]],
    const device int* parents [[buffer(12)]],
    device float* tree_states [[buffer(13)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float k_token[kMaxGenericKeyDim];
  threadgroup float q_token[kMaxGenericKeyDim];

  const uint row = group.x * kRecurrentGenericRows + tid;
  const uint h = group.y;
  const uint b = group.z;
  const bool owns_row = row < p.value_dim;
  const uint kh = key_head_of(p, h);
  const uint state_row = ((b * p.value_heads + h) * p.value_dim + row) * p.key_dim;
  if (owns_row) {
    for (uint c = 0; c < p.key_dim; ++c) {
      state_out[state_row + c] = state_in[state_row + c];
    }
  }
  uint next_checkpoint = 0;
  for (uint t = 0; t < p.tokens; ++t) {
    const uint out = v_offset(p, b, t, h) + row;
    if (p.has_tree != 0 && owns_row) {
      const int parent = parents[t];
      for (uint c = 0; c < p.key_dim; ++c) {
        state_out[state_row + c] =
            parent < 0 ? state_in[state_row + c]
                       : tree_states[tree_state_row(p, b, h, uint(parent), row) + c];
      }
    }
    // The mask is uniform across the threadgroup, so are its barriers.
    if (token_is_masked(p, mask, b, t)) {
      if (owns_row) {
        y[out] = static_cast<T>(0.0f);
      }
    } else {
      // Every row is done with the previous token's q and k.
      threadgroup_barrier(mem_flags::mem_threadgroup);
      const uint qk = qk_offset(p, b, t, kh);
      for (uint c = tid; c < p.key_dim; c += kRecurrentGenericRows) {
        k_token[c] = float(k[qk + c]);
        q_token[c] = float(q[qk + c]);
      }
      // The token's q and k are staged before any row reads them.
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (owns_row) {
        float k_scale = 1.0f;
        float q_scale = 1.0f;
        if (p.normalize_qk != 0) {
          float k_squares = 0.0f;
          float q_squares = 0.0f;
          for (uint c = 0; c < p.key_dim; ++c) {
            k_squares += k_token[c] * k_token[c];
            q_squares += q_token[c] * q_token[c];
          }
          k_scale = 1.0f / sqrt(k_squares + 1e-6f);
          q_scale = 1.0f / sqrt(q_squares + 1e-6f);
        }
        const uint gate = gate_offset(p, b, t, h);
        const bool per_key = p.per_key_gates != 0;
        const float decay = per_key ? 1.0f : exp(g[gate]);
        float prediction = 0.0f;
        for (uint c = 0; c < p.key_dim; ++c) {
          const float column_decay = per_key ? exp(g[key_gate_offset(p, gate, c)]) : decay;
          float decayed = state_out[state_row + c] * column_decay;
          state_out[state_row + c] = decayed;
          prediction += decayed * k_token[c];
        }
        const float delta = beta[gate] * (float(v[out]) - prediction * k_scale);
        float readout = 0.0f;
        for (uint c = 0; c < p.key_dim; ++c) {
          float updated = state_out[state_row + c] + delta * k_token[c] * k_scale;
          state_out[state_row + c] = updated;
          readout += updated * q_token[c];
        }
        y[out] = static_cast<T>(readout * q_scale * p.scale);
      }
    }
    if (p.has_tree != 0 && owns_row) {
      for (uint c = 0; c < p.key_dim; ++c) {
        tree_states[tree_state_row(p, b, h, t, row) + c] = state_out[state_row + c];
      }
    }
    if (checkpoint_at(p, checkpoints, next_checkpoint, t + 1)) {
      if (owns_row) {
        const uint slot = checkpoint_offset(p, next_checkpoint) + state_row;
        for (uint c = 0; c < p.key_dim; ++c) {
          checkpoint_states[slot + c] = state_out[state_row + c];
        }
      }
      ++next_checkpoint;
    }
  }
}

instantiate_kernel("gated_delta_recurrent_simd_float32", gated_delta_recurrent_simd, float)
instantiate_kernel("gated_delta_recurrent_simd_float16", gated_delta_recurrent_simd, half)
instantiate_kernel("gated_delta_recurrent_simd_bfloat16", gated_delta_recurrent_simd, bfloat)
instantiate_kernel("gated_delta_recurrent_generic_float32", gated_delta_recurrent_generic, float)
instantiate_kernel("gated_delta_recurrent_generic_float16", gated_delta_recurrent_generic, half)
instantiate_kernel("gated_delta_recurrent_generic_bfloat16", gated_delta_recurrent_generic, bfloat)
