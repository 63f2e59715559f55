// qk_norm (normalize_qk only): 1 / sqrt(sum(x * x) + 1e-6) of every q and k
// row, in float32, for the chunked stages to fold into their dot products.

#include "gated_delta_common.h"

// One SIMD-group per (batch, token, key head) row.
template <typename T>
[[kernel]] void gated_delta_qk_norm(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    device float* query_inverse_norm [[buffer(2)]],
    device float* key_inverse_norm [[buffer(3)]],
    constant GatedDeltaKernelParams& p [[buffer(4)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint row = group.x * kNormRowsPerThreadgroup + simd_index;
  const uint rows = p.batch * p.tokens * p.key_heads;
  // Uniform across the SIMD-group.
  if (row >= rows) {
    return;
  }
  float q_squares = 0.0f;
  float k_squares = 0.0f;
  for (uint d = lane; d < p.key_dim; d += 32) {
    float qd = float(q[row * p.key_dim + d]);
    float kd = float(k[row * p.key_dim + d]);
    q_squares += qd * qd;
    k_squares += kd * kd;
  }
  q_squares = simd_sum(q_squares);
  k_squares = simd_sum(k_squares);
  if (lane == 0) {
    query_inverse_norm[row] = 1.0f / sqrt(q_squares + 1e-6f);
    key_inverse_norm[row] = 1.0f / sqrt(k_squares + 1e-6f);
  }
}

instantiate_kernel("gated_delta_qk_norm_float32", gated_delta_qk_norm, float)
instantiate_kernel("gated_delta_qk_norm_float16", gated_delta_qk_norm, half)
instantiate_kernel("gated_delta_qk_norm_bfloat16", gated_delta_qk_norm, bfloat)
