// gated_norm: out = rms_norm(y, eps) * norm_weight * silu(z) (sigmoid(z)
// with sigmoid_output_gate) per (token, value head), float32 math from the
// core's float32 y; out in the activation dtype, 0 on masked tokens.

#include "segment_common.h"

// One SIMD-group per (batch, token, value head) row.
template <typename T>
[[kernel]] void gated_delta_segment_gated_norm(
    const device float* y [[buffer(0)]],
    const device T* mixed [[buffer(1)]],
    const device float* norm_weight [[buffer(2)]],
    const device bool* mask [[buffer(3)]],
    device T* out [[buffer(4)]],
    constant SegmentKernelParams& p [[buffer(5)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint row = group.x * kGatedNormRowsPerThreadgroup + simd_index;
  // Both exits are uniform across the SIMD-group.
  if (row >= p.batch * p.tokens * p.value_heads) {
    return;
  }
  const uint token_row = row / p.value_heads;
  const uint h = row % p.value_heads;
  device T* destination = out + row * p.value_dim;
  if (p.has_mask != 0 && !mask[token_row]) {
    for (uint d = lane; d < p.value_dim; d += 32) {
      destination[d] = T(0.0f);
    }
    return;
  }
  const device float* y_row = y + row * p.value_dim;
  float squares = 0.0f;
  for (uint d = lane; d < p.value_dim; d += 32) {
    squares += y_row[d] * y_row[d];
  }
  squares = simd_sum(squares);
  const float inverse_rms = 1.0f / sqrt(squares / float(p.value_dim) + p.norm_eps);
  const device T* z = mixed + token_row * p.mixed_qkvzba_width + p.z_offset + h * p.value_dim;
  for (uint d = lane; d < p.value_dim; d += 32) {
    const float gate = p.sigmoid_output_gate != 0 ? segment_sigmoid(float(z[d]))
                                                  : segment_silu(float(z[d]));
    destination[d] = T(y_row[d] * inverse_rms * norm_weight[d] * gate);
  }
}

instantiate_kernel("gated_delta_segment_gated_norm_float32", gated_delta_segment_gated_norm, float)
instantiate_kernel("gated_delta_segment_gated_norm_float16", gated_delta_segment_gated_norm, half)
instantiate_kernel("gated_delta_segment_gated_norm_bfloat16", gated_delta_segment_gated_norm, bfloat)
