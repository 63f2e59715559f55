// Shared by the fused layer segment's own stages (prepare_conv,
// prepare_gates, collect_conv_state, gated_norm): the mask and the float32
// activation functions. Conservative MSL, like gated_delta_common.h.
#pragma once

#include "gated_delta_common.h"

inline bool segment_token_is_kept(constant SegmentKernelParams& p, const device bool* mask,
                                  uint b, uint t) {
  return p.has_mask == 0 || mask[b * p.tokens + t];
}

inline float segment_sigmoid(float x) {
  return 1.0f / (1.0f + exp(-x));
}

inline float segment_silu(float x) {
  return x * segment_sigmoid(x);
}

// log(1 + exp(x)) without overflow for large x. MSL has no log1p: for very
// negative x, log(1 + e) would round the small e away, so its series
// e - e^2 / 2 (error below e^3 / 3) takes over there.
inline float segment_softplus(float x) {
  const float e = exp(x > 0.0f ? -x : x);  // exp(-|x|)
  const float positive_part = x > 0.0f ? x : 0.0f;
  return positive_part + (e < 1e-3f ? e * (1.0f - 0.5f * e) : log(1.0f + e));
}
