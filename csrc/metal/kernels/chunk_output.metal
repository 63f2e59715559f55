// chunk_output: y of one chunk of one (batch, value head), all chunks in
// parallel once chunk_carry has produced v' and the entry state's share:
//
//   y_i = inter_i + scale sum_{j <= i} decay(i, j) (q_i . k_j) v'_j
//
// and y = 0 on masked tokens. Per-key gates: chunk_qk's tile is the value
// head's, with the decays inside.

#include "gated_delta_common.h"

template <typename T>
[[kernel]] void gated_delta_chunk_output(
    const device float* qk [[buffer(0)]],
    const device float* gate_cumsum [[buffer(1)]],
    const device ulong* wipe_mask [[buffer(2)]],
    const device bool* mask [[buffer(3)]],
    const device float* corrected [[buffer(4)]],
    const device float* output_inter [[buffer(5)]],
    device T* y [[buffer(6)]],
    constant GatedDeltaKernelParams& p [[buffer(7)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float weights[kChunkSize * kChunkSize];
  const uint chunk = group.x;
  const uint h = group.y;
  const uint b = group.z;
  const uint kh = key_head_of(p, h);
  const uint length = chunk_length(p, chunk);
  const uint first_token = chunk * kChunkSize;
  const uint rows = chunk_row(p, b, h, p.value_heads, chunk);
  const bool per_key = p.per_key_gates != 0;
  const uint tile = per_key ? chunk_row(p, b, h, p.value_heads, chunk) * kChunkSize
                            : chunk_row(p, b, kh, p.key_heads, chunk) * kChunkSize;

  for (uint e = tid; e < kChunkSize * kChunkSize; e += kChunkThreads) {
    const uint i = e / kChunkSize;
    const uint j = e % kChunkSize;
    float weight = 0.0f;
    if (j <= i && i < length) {
      const float decay =
          per_key ? 1.0f : chunk_decay(gate_cumsum + rows, wipe_mask + rows / kChunkSize, i, j);
      weight = p.scale * decay * qk[tile + e];
    }
    weights[e] = weight;
  }
  // The decayed, scaled Q K^T is staged before any output reads it.
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (uint e = tid; e < length * p.value_dim; e += kChunkThreads) {
    const uint i = e / p.value_dim;
    const uint column = e % p.value_dim;
    const uint token = first_token + i;
    float value = 0.0f;
    if (!token_is_masked(p, mask, b, token)) {
      value = output_inter[(rows + i) * p.value_dim + column];
      for (uint j = 0; j <= i; ++j) {
        value += weights[i * kChunkSize + j] * corrected[(rows + j) * p.value_dim + column];
      }
    }
    y[v_offset(p, b, token, h) + column] = static_cast<T>(value);
  }
}

instantiate_kernel("gated_delta_chunk_output_float32", gated_delta_chunk_output, float)
instantiate_kernel("gated_delta_chunk_output_float16", gated_delta_chunk_output, half)
instantiate_kernel("gated_delta_chunk_output_bfloat16", gated_delta_chunk_output, bfloat)
