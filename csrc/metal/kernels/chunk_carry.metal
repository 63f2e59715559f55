// chunk_carry: the only sequential stage. For kCarryRows rows of the state of
// one (batch, value head), walk the chunks in order; with S the state the
// chunk starts from (rows of S evolve independently):
//
//   v'_j        = U_j - W_j S^T                          (corrected values)
//   inter_i     = scale Gamma_i S q_i                    (the entry state's share of y_i)
//   S          <- Gamma_last S + sum_j decay(last, j) v'_j k_j^T
//
// v' overwrites U (each element is read, then written, by the same thread)
// and, with inter, feeds chunk_output; the last S is the final state.
//
// chunk_checkpoint, inside this kernel (with checkpoints): the state after the
// first i tokens of a chunk is the same update cut at i,
//
//   S_i = Gamma_{i-1} S + sum_{j < i} decay(i-1, j) v'_j k_j^T,
//
// computed from the entry S before it is overwritten, and copied out.
//
// Per-key gates: the decays are per key column c (channel_decay): Gamma_i
// scales q_i's columns in inter_i, and column c of S decays by its own
// Gamma_last,c and decay(last, j, c).

#include "gated_delta_common.h"

// 64 threads per state row: thread (row, j) computes token j's v' and inter,
// then key columns j, j + 64, ... of the row's update.
template <typename T>
[[kernel]] void gated_delta_chunk_carry(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device float* query_inverse_norm [[buffer(2)]],
    const device float* key_inverse_norm [[buffer(3)]],
    const device float* gate_cumsum [[buffer(4)]],
    const device ulong* wipe_mask [[buffer(5)]],
    const device float* w [[buffer(6)]],
    device float* u [[buffer(7)]],
    const device float* state_in [[buffer(8)]],
    device float* state_out [[buffer(9)]],
    device float* output_inter [[buffer(10)]],
    constant GatedDeltaKernelParams& p [[buffer(11)]],
    const device int* checkpoints [[buffer(12)]],
    device float* checkpoint_states [[buffer(13)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float state[kCarryRows * kMaxChunkedKeyDim];
  threadgroup float corrected[kCarryRows * kChunkSize];
  threadgroup float decay_from_start[kChunkSize];
  threadgroup float decay_to_end[kChunkSize];
  const uint h = group.y;
  const uint b = group.z;
  const uint kh = key_head_of(p, h);
  const bool per_key = p.per_key_gates != 0;
  const uint local_row = tid / kChunkSize;
  const uint lane = tid % kChunkSize;
  const uint row = group.x * kCarryRows + local_row;
  const bool owns_row = row < p.value_dim;
  const uint state_row = ((b * p.value_heads + h) * p.value_dim + row) * p.key_dim;
  threadgroup float* s = state + local_row * kMaxChunkedKeyDim;

  if (owns_row) {
    for (uint c = lane; c < p.key_dim; c += kChunkSize) {
      s[c] = state_in[state_row + c];
    }
  }
  uint next_checkpoint = 0;
  for (uint chunk = 0; chunk < p.num_chunks; ++chunk) {
    const uint length = chunk_length(p, chunk);
    const uint first_token = chunk * kChunkSize;
    const uint rows = chunk_row(p, b, h, p.value_heads, chunk);
    const device float* cumsum = gate_cumsum + rows * gate_width(p);
    const device ulong* wipe = wipe_mask + rows / kChunkSize * gate_width(p);
    // Scalar gates: the head's decays, staged once per chunk (per-key gates
    // form each column's where it is used).
    if (!per_key && tid < kChunkSize) {
      const uint j = tid;
      decay_from_start[j] = j < length ? decay_from_chunk_start(cumsum, wipe, j) : 0.0f;
      decay_to_end[j] = j < length ? chunk_decay(cumsum, wipe, length - 1, j) : 0.0f;
    }
    // The decays are staged, and the previous chunk's update of S is complete.
    threadgroup_barrier(mem_flags::mem_threadgroup);

    if (owns_row && lane < length) {
      const uint j = lane;
      const uint token = first_token + j;
      const uint key = qk_offset(p, b, token, kh);
      float w_s = 0.0f;
      float s_q = 0.0f;
      for (uint c = 0; c < p.key_dim; ++c) {
        w_s += w[(rows + j) * p.key_dim + c] * s[c];
        const float q_c = float(q[key + c]);
        s_q += s[c] * (per_key ? channel_decay(p, cumsum, wipe, j, -1, c) * q_c : q_c);
      }
      if (p.normalize_qk != 0) {
        s_q *= query_inverse_norm[(b * p.tokens + token) * p.key_heads + kh];
      }
      const uint at = (rows + j) * p.value_dim + row;
      const float v_new = u[at] - w_s;
      u[at] = v_new;
      corrected[local_row * kChunkSize + j] = v_new;
      output_inter[at] = p.scale * (per_key ? 1.0f : decay_from_start[j]) * s_q;
    }
    // Every v' of the chunk is known, and every read of the entry S is done.
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // chunk_checkpoint: each thread reads only the entry S columns it updates
    // below, so no barrier is needed before the update.
    while (next_checkpoint < p.num_checkpoints &&
           uint(checkpoints[next_checkpoint]) <= first_token + length) {
      const uint cut = uint(checkpoints[next_checkpoint]) - first_token;  // 1..length
      if (owns_row) {
        const uint slot = checkpoint_offset(p, next_checkpoint) + state_row;
        for (uint c = lane; c < p.key_dim; c += kChunkSize) {
          const float channel_decay_from_start = channel_decay(p, cumsum, wipe, cut - 1, -1, c);
          float sum = 0.0f;
          for (uint j = 0; j < cut; ++j) {
            const uint token = first_token + j;
            float key_scale = 1.0f;
            if (p.normalize_qk != 0) {
              key_scale = key_inverse_norm[(b * p.tokens + token) * p.key_heads + kh];
            }
            sum += channel_decay(p, cumsum, wipe, cut - 1, int(j), c) *
                   corrected[local_row * kChunkSize + j] * key_scale *
                   float(k[qk_offset(p, b, token, kh) + c]);
          }
          checkpoint_states[slot + c] = channel_decay_from_start * s[c] + sum;
        }
      }
      ++next_checkpoint;
    }

    if (owns_row) {
      for (uint c = lane; c < p.key_dim; c += kChunkSize) {
        const float decay_all = per_key ? channel_decay(p, cumsum, wipe, length - 1, -1, c)
                                        : decay_from_start[length - 1];
        float sum = 0.0f;
        for (uint j = 0; j < length; ++j) {
          const uint token = first_token + j;
          float key_scale = 1.0f;
          if (p.normalize_qk != 0) {
            key_scale = key_inverse_norm[(b * p.tokens + token) * p.key_heads + kh];
          }
          const float decay =
              per_key ? channel_decay(p, cumsum, wipe, length - 1, int(j), c) : decay_to_end[j];
          sum += decay * corrected[local_row * kChunkSize + j] * key_scale *
                 float(k[qk_offset(p, b, token, kh) + c]);
        }
        s[c] = decay_all * s[c] + sum;
      }
    }
    // The decays and v' are read before the next chunk overwrites them.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (owns_row) {
    for (uint c = lane; c < p.key_dim; c += kChunkSize) {
      state_out[state_row + c] = s[c];
    }
  }
}

instantiate_kernel("gated_delta_chunk_carry_float32", gated_delta_chunk_carry, float)
instantiate_kernel("gated_delta_chunk_carry_float16", gated_delta_chunk_carry, half)
instantiate_kernel("gated_delta_chunk_carry_bfloat16", gated_delta_chunk_carry, bfloat)
