// Shared by the backward's stages (boundary_states, chunk_states,
// recurrent_chunk_backward, qk_grad_reduce): the stacks of saved states, one token's
// vectors spread over a SIMD-group's lanes, and one token of the forward for
// one state row. Conservative MSL, like gated_delta_common.h.
//
// A lane holds the key columns lane + 32 m, m < kBackwardColumnsPerLane, of
// a row; columns past the key dim hold 0 and are never written.
#pragma once

#include "gated_delta_common.h"

// Row `row` of slot `slot` of a per-(batch, value head) stack of states laid
// out [B, Hv, slots, Dv, Dk]: the chunk-boundary states (slots = num_chunks)
// and the states inside one chunk (slots = kChunkSize).
inline uint state_stack_row(constant GatedDeltaKernelParams& p, uint b, uint h, uint slots,
                            uint slot, uint row) {
  return (((b * p.value_heads + h) * slots + slot) * p.value_dim + row) * p.key_dim;
}
// Row `row` of a state [B, Hv, Dv, Dk] (state_in, its cotangent, dstate).
inline uint state_row_offset(constant GatedDeltaKernelParams& p, uint b, uint h, uint row) {
  return ((b * p.value_heads + h) * p.value_dim + row) * p.key_dim;
}

// This lane's columns of the q or k row at `offset`, in float32, L2-normalised
// as the forward normalises them (normalize_qk): every lane of the SIMD-group
// must call it.
template <typename T>
inline void load_key_lanes(const device T* x, uint offset, constant GatedDeltaKernelParams& p,
                           uint lane, thread float* out) {
  float squares = 0.0f;
  for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
    const uint c = lane + 32 * m;
    out[m] = c < p.key_dim ? float(x[offset + c]) : 0.0f;
    squares += out[m] * out[m];
  }
  squares = simd_sum(squares);
  const float scale = p.normalize_qk != 0 ? 1.0f / sqrt(squares + 1e-6f) : 1.0f;
  for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
    out[m] *= scale;
  }
}

// The linear decay of this lane's columns at gate index `gate`: exp(g), one
// per head or, with per-key gates, one per column (0 past the key dim).
// exp(-inf) = 0: a wipe.
inline void load_decay_lanes(const device float* g, uint gate, constant GatedDeltaKernelParams& p,
                             uint lane, thread float* out) {
  const float head_decay = p.per_key_gates != 0 ? 0.0f : exp(g[gate]);
  for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
    const uint c = lane + 32 * m;
    out[m] = p.per_key_gates != 0 ? (c < p.key_dim ? exp(g[key_gate_offset(p, gate, c)]) : 0.0f)
                                  : head_decay;
  }
}

// One active token of the forward on one state row held in `s` (this lane's
// columns): S <- a S; d = beta (v - S k); S += d k^T. Every lane of the
// SIMD-group must call it.
inline void forward_row_step(thread float* s, const thread float* k_lanes,
                             const thread float* decays, float value, float beta) {
  float prediction = 0.0f;
  for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
    s[m] *= decays[m];
    prediction += s[m] * k_lanes[m];
  }
  prediction = simd_sum(prediction);
  const float delta = beta * (value - prediction);
  for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
    s[m] += delta * k_lanes[m];
  }
}

// Token t of row `row` of head (b, h) through forward_row_step, when active
// (a masked token leaves the state as it is). Every lane must call it.
template <typename T>
inline void forward_token(const device T* k, const device T* v, const device float* g,
                          const device float* beta, const device bool* mask,
                          constant GatedDeltaKernelParams& p, uint b, uint h, uint t, uint row,
                          uint lane, thread float* s) {
  if (token_is_masked(p, mask, b, t)) {
    return;
  }
  float k_lanes[kBackwardColumnsPerLane];
  float decays[kBackwardColumnsPerLane];
  load_key_lanes(k, qk_offset(p, b, t, key_head_of(p, h)), p, lane, k_lanes);
  const uint gate = gate_offset(p, b, t, h);
  load_decay_lanes(g, gate, p, lane, decays);
  forward_row_step(s, k_lanes, decays, float(v[v_offset(p, b, t, h) + row]), beta[gate]);
}

// Copies this lane's columns of a row between registers and device memory.
inline void load_row_lanes(const device float* row, constant GatedDeltaKernelParams& p, uint lane,
                           thread float* s) {
  for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
    const uint c = lane + 32 * m;
    s[m] = c < p.key_dim ? row[c] : 0.0f;
  }
}
inline void store_row_lanes(device float* row, constant GatedDeltaKernelParams& p, uint lane,
                            const thread float* s) {
  for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
    const uint c = lane + 32 * m;
    if (c < p.key_dim) {
      row[c] = s[m];
    }
  }
}

// The chunked (WY) backward's test, per chunk: whether every active token of
// the chunk decays by a normal float. The WY stages run the chunks where it
// holds (they form each decay as the exp of a difference of the in-chunk
// cumulative log decays, which a wipe makes -inf); chunk_states and
// recurrent_chunk_backward, the recurrent reverse, run the others (a wipe,
// gamma == 0, or a subnormal decay), as the CPU decides (docs/numerics.md,
// "The chunked backward"); with per-key gates every channel's decay must be
// normal. It reads the backward's gate_cumsum record of the chunk's tiny
// decays, one word per gate channel, not the chunk's g (64 x Dk floats with
// per-key gates, in each of the stages). Every kernel of the plan reads the
// same record, so each chunk goes to exactly one of the two forms. Uniform
// per threadgroup.
inline bool chunk_decays_normal(const device ulong* tiny_decay_mask,
                                constant GatedDeltaKernelParams& p, uint b, uint h, uint chunk) {
  const uint width = gate_width(p);
  const uint words = chunk_row(p, b, h, p.value_heads, chunk) / kChunkSize * width;
  for (uint c = 0; c < width; ++c) {
    if (tiny_decay_mask[words + c] != 0ul) {
      return false;
    }
  }
  return true;
}

// The in-chunk cumulative log decay G of token i in key column c, from
// gate_cumsum's rows of one chunk at `cumsum` (one column with scalar gates,
// Dk with per-key gates). The WY stages run only chunks without a wipe, so
// every decay they need is exp(G_ic - G_jc), or exp(G_ic) from the chunk's
// start.
inline float chunk_log_decay(constant GatedDeltaKernelParams& p, const device float* cumsum,
                             uint i, uint c) {
  return p.per_key_gates != 0 ? cumsum[i * p.key_dim + c] : cumsum[i];
}

// Column c of token t's q or k row for key head kh, in float32, normalised
// through the forward's qk_norm output (inverse_norm) when normalize_qk.
template <typename T>
inline float normalized_key(const device T* x, const device float* inverse_norm,
                            constant GatedDeltaKernelParams& p, uint b, uint t, uint kh, uint c) {
  const float value = float(x[qk_offset(p, b, t, kh) + c]);
  return p.normalize_qk != 0 ? value * inverse_norm[(b * p.tokens + t) * p.key_heads + kh] : value;
}
