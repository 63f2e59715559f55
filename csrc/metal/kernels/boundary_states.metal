// boundary_states, the backward's first stage: the forward once more, keeping
// only the state entering each chunk of kChunkSize tokens (num_chunks states
// per (batch, value head), the O(T / 64) memory of the backward), and the
// seed of the carried state cotangent: dstate starts as the cotangent of the
// final state, and recurrent_chunk_backward takes it back through every token.
//
// Rows of the state evolve independently, so each SIMD-group owns one row
// and walks the tokens with it in registers. The state leaving the last chunk
// is never needed.

#include "backward_common.h"

template <typename T>
[[kernel]] void gated_delta_boundary_states(
    const device T* k [[buffer(0)]],
    const device T* v [[buffer(1)]],
    const device float* g [[buffer(2)]],
    const device float* beta [[buffer(3)]],
    const device bool* mask [[buffer(4)]],
    const device float* state_in [[buffer(5)]],
    const device float* state_cotangent [[buffer(6)]],
    device float* boundary_states [[buffer(7)]],
    device float* dstate [[buffer(8)]],
    constant GatedDeltaKernelParams& p [[buffer(9)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint row = group.x * kBackwardRows + simd_index;
  const uint h = group.y;
  const uint b = group.z;
  // Uniform across the SIMD-group: a whole SIMD-group past the last row leaves.
  if (row >= p.value_dim) {
    return;
  }
  const uint state = state_row_offset(p, b, h, row);
  float s[kBackwardColumnsPerLane];
  load_row_lanes(state_cotangent + state, p, lane, s);
  store_row_lanes(dstate + state, p, lane, s);

  load_row_lanes(state_in + state, p, lane, s);
  for (uint chunk = 0; chunk < p.num_chunks; ++chunk) {
    store_row_lanes(boundary_states + state_stack_row(p, b, h, p.num_chunks, chunk, row), p,
                    lane, s);
    if (chunk + 1 == p.num_chunks) {
      break;
    }
    const uint end = (chunk + 1) * kChunkSize;
    for (uint t = chunk * kChunkSize; t < end; ++t) {
      forward_token(k, v, g, beta, mask, p, b, h, t, row, lane, s);
    }
  }
}

instantiate_kernel("gated_delta_boundary_states_float32", gated_delta_boundary_states, float)
instantiate_kernel("gated_delta_boundary_states_float16", gated_delta_boundary_states, half)
instantiate_kernel("gated_delta_boundary_states_bfloat16", gated_delta_boundary_states, bfloat)
