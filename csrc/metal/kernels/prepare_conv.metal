// prepare_conv: the causal depthwise conv over the q|k|v channels of every
// unmasked token, the carried conv state in front of the call's tokens, then
// SiLU; written float32 (never rounded to the activation dtype) into q, k and
// v in the core's layouts ([B, T, H, D]), which the core's stages then read.
// Skip semantics: a masked token is in no window, and its rows are 0.

#include "segment_common.h"

// One thread per (channel, token, batch).
template <typename T>
[[kernel]] void gated_delta_segment_prepare_conv(
    const device T* mixed [[buffer(0)]],
    const device float* conv_weight [[buffer(1)]],
    const device T* conv_state [[buffer(2)]],
    const device bool* mask [[buffer(3)]],
    device float* q [[buffer(4)]],
    device float* k [[buffer(5)]],
    device float* v [[buffer(6)]],
    constant SegmentKernelParams& p [[buffer(7)]],
    uint3 position [[thread_position_in_grid]]) {
  const uint c = position.x;
  const uint t = position.y;
  const uint b = position.z;
  if (c >= p.conv_channels) {
    return;
  }
  float sum = 0.0f;
  if (segment_token_is_kept(p, mask, b, t)) {
    // The window, newest first: this token, the unmasked tokens before it,
    // then, when the call has too few, the conv state from its newest row.
    const device float* taps = conv_weight + c * p.conv_kernel;
    int token = int(t);
    int state_row = int(p.conv_kernel) - 2;
    for (int tap = int(p.conv_kernel) - 1; tap >= 0; --tap) {
      while (token >= 0 && !segment_token_is_kept(p, mask, b, uint(token))) {
        --token;
      }
      float x;
      if (token >= 0) {
        x = float(mixed[(b * p.tokens + uint(token)) * p.mixed_qkvzba_width + c]);
        --token;
      } else {
        x = float(conv_state[(b * (p.conv_kernel - 1) + uint(state_row)) * p.conv_channels + c]);
        --state_row;
      }
      sum += taps[tap] * x;
    }
    sum = segment_silu(sum);
  }
  const uint row = b * p.tokens + t;
  const uint qk_width = p.key_heads * p.key_dim;
  if (c < qk_width) {
    q[row * qk_width + c] = sum;
  } else if (c < 2 * qk_width) {
    k[row * qk_width + c - qk_width] = sum;
  } else {
    v[row * (p.value_heads * p.value_dim) + c - 2 * qk_width] = sum;
  }
}

instantiate_kernel("gated_delta_segment_prepare_conv_float32", gated_delta_segment_prepare_conv, float)
instantiate_kernel("gated_delta_segment_prepare_conv_float16", gated_delta_segment_prepare_conv, half)
instantiate_kernel("gated_delta_segment_prepare_conv_bfloat16", gated_delta_segment_prepare_conv, bfloat)
