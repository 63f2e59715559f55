// chunk_states, once per chunk from the last to the first (the plan's
// dispatch says which): the kChunkSize states inside that chunk, recomputed
// from its boundary state: states[i] is the state before token
// chunk * kChunkSize + i (states[0] the boundary state itself), for
// recurrent_chunk_backward to read. The state after the chunk's last token is never
// needed: recurrent_chunk_backward forms each state after a token from the one before
// it (see recurrent_chunk_backward.metal).
//
// One SIMD-group per state row, as in boundary_states.

#include "backward_common.h"

template <typename T>
[[kernel]] void gated_delta_chunk_states(
    const device T* k [[buffer(0)]],
    const device T* v [[buffer(1)]],
    const device float* g [[buffer(2)]],
    const device float* beta [[buffer(3)]],
    const device bool* mask [[buffer(4)]],
    const device float* boundary_states [[buffer(5)]],
    device float* chunk_states [[buffer(6)]],
    constant GatedDeltaKernelParams& p [[buffer(7)]],
    constant uint& chunk [[buffer(8)]],
    const device ulong* tiny_decay_mask [[buffer(9)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint row = group.x * kBackwardRows + simd_index;
  const uint h = group.y;
  const uint b = group.z;
  // Uniform across the SIMD-group.
  if (row >= p.value_dim) {
    return;
  }
  // The chunked backward's WY stages take this chunk (uniform too).
  if (p.recurrent_wipe_chunks_only != 0 && chunk_decays_normal(tiny_decay_mask, p, b, h, chunk)) {
    return;
  }
  float s[kBackwardColumnsPerLane];
  load_row_lanes(boundary_states + state_stack_row(p, b, h, p.num_chunks, chunk, row), p, lane,
                 s);
  const uint length = chunk_length(p, chunk);
  for (uint i = 0; i < length; ++i) {
    store_row_lanes(chunk_states + state_stack_row(p, b, h, kChunkSize, i, row), p, lane, s);
    if (i + 1 < length) {
      forward_token(k, v, g, beta, mask, p, b, h, chunk * kChunkSize + i, row, lane, s);
    }
  }
}

instantiate_kernel("gated_delta_chunk_states_float32", gated_delta_chunk_states, float)
instantiate_kernel("gated_delta_chunk_states_float16", gated_delta_chunk_states, half)
instantiate_kernel("gated_delta_chunk_states_bfloat16", gated_delta_chunk_states, bfloat)
