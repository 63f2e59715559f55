// qk_grad_reduce, the backward's last stage: per (batch, token, key head), the
// gradient c of the (normalised) q or k row, summed over the value heads that
// read that key head (float32, from recurrent_chunk_backward), then, with normalize_qk,
// taken back through x / n, n = sqrt(x . x + eps), and written in the
// activation dtype.
//
// The exact gradient (c - u (u . c)) / n, u = x / n, cancels along x, where
// only c eps / n^3 is left: 1 - u . u formed in float32 would lose it (all of
// it when Dk = 1). Split c along the unit vector x^ = x / |x| instead:
//
//   dx = (c - x^ (x^ . c)) / n  +  x^ (x^ . c) eps / (n^2 n)
//
// The first term is c's part across x (small only where c lies along x, and
// then with an error of the order of |c| ulp), the second a product of
// positive factors: neither cancels, so float32 keeps both to a few ulp
// (docs/numerics.md, the backward). x = 0 (or x . x under float32's range)
// leaves c / n.

#include "backward_common.h"

// One (batch, token, key head) row of q or k: `raw` is the forward's input,
// `head_grads` the per-value-head gradients [B, T, Hv, Dk] of that input.
template <typename T>
inline void reduce_row(const device T* raw, const device float* head_grads, device T* out,
                       constant GatedDeltaKernelParams& p, uint bt, uint kh, uint lane) {
  const uint ratio = p.value_heads_per_key_head;
  const uint row = (bt * p.key_heads + kh) * p.key_dim;
  float c_lanes[kBackwardColumnsPerLane];
  for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
    c_lanes[m] = 0.0f;
  }
  for (uint n = 0; n < ratio; ++n) {
    const uint head = p.head_mapping == 0 ? kh * ratio + n : kh + n * p.key_heads;
    const uint grads = (bt * p.value_heads + head) * p.key_dim;
    for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
      const uint c = lane + 32 * m;
      c_lanes[m] += c < p.key_dim ? head_grads[grads + c] : 0.0f;
    }
  }
  if (p.normalize_qk != 0) {
    float x_lanes[kBackwardColumnsPerLane];
    float squares = 0.0f;
    for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
      const uint c = lane + 32 * m;
      x_lanes[m] = c < p.key_dim ? float(raw[row + c]) : 0.0f;
      squares += x_lanes[m] * x_lanes[m];
    }
    squares = simd_sum(squares);
    const float norm_squared = squares + 1e-6f;  // the forward's eps
    const float inverse_norm = 1.0f / sqrt(norm_squared);
    if (squares > 0.0f) {
      const float inverse_length = 1.0f / sqrt(squares);
      float along = 0.0f;
      for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
        x_lanes[m] *= inverse_length;
        along += x_lanes[m] * c_lanes[m];
      }
      along = simd_sum(along);
      const float kept_along = along * (1e-6f / norm_squared) * inverse_norm;
      for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
        c_lanes[m] = (c_lanes[m] - x_lanes[m] * along) * inverse_norm + x_lanes[m] * kept_along;
      }
    } else {
      for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
        c_lanes[m] *= inverse_norm;
      }
    }
  }
  for (uint m = 0; m < kBackwardColumnsPerLane; ++m) {
    const uint c = lane + 32 * m;
    if (c < p.key_dim) {
      out[row + c] = static_cast<T>(c_lanes[m]);
    }
  }
}

// One SIMD-group per (batch, token, key head) row, for q and then k.
template <typename T>
[[kernel]] void gated_delta_qk_grad_reduce(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device float* query_head_grad [[buffer(2)]],
    const device float* key_head_grad [[buffer(3)]],
    device T* dq [[buffer(4)]],
    device T* dk [[buffer(5)]],
    constant GatedDeltaKernelParams& p [[buffer(6)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint simd_index [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint row = group.x * kGradReduceRowsPerThreadgroup + simd_index;
  // Uniform across the SIMD-group.
  if (row >= p.batch * p.tokens * p.key_heads) {
    return;
  }
  const uint bt = row / p.key_heads;
  const uint kh = row % p.key_heads;
  reduce_row(q, query_head_grad, dq, p, bt, kh, lane);
  reduce_row(k, key_head_grad, dk, p, bt, kh, lane);
}

instantiate_kernel("gated_delta_qk_grad_reduce_float32", gated_delta_qk_grad_reduce, float)
instantiate_kernel("gated_delta_qk_grad_reduce_float16", gated_delta_qk_grad_reduce, half)
instantiate_kernel("gated_delta_qk_grad_reduce_bfloat16", gated_delta_qk_grad_reduce, bfloat)
