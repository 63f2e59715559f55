// collect_conv_state: the new conv state, the last K - 1 pre-conv inputs of
// each batch row that the conv saw: its carried conv state (oldest first),
// then the call's unmasked tokens. Copied in the activation dtype, exactly.
// collect_conv_checkpoints: the same, for the call cut after each
// checkpoint's tokens.

#include "segment_common.h"

// Channel c of row r of batch row b's conv state after the first `tokens`
// tokens of the call. Row r is the (rows - r)-th newest input: walk back over
// the unmasked tokens; when they run out, it is a row of the carried state.
template <typename T>
inline T conv_state_entry(constant SegmentKernelParams& p, const device T* mixed,
                          const device T* conv_state_in, const device bool* mask, uint b,
                          uint r, uint c, uint tokens) {
  const uint rows = p.conv_kernel - 1;
  uint wanted = rows - r;
  int token = int(tokens) - 1;
  for (; token >= 0; --token) {
    if (segment_token_is_kept(p, mask, b, uint(token))) {
      --wanted;
      if (wanted == 0) {
        break;
      }
    }
  }
  if (token >= 0) {
    return mixed[(b * p.tokens + uint(token)) * p.mixed_qkvzba_width + c];
  }
  return conv_state_in[(b * rows + rows - wanted) * p.conv_channels + c];
}

// One thread per (channel, row of the new conv state, batch).
template <typename T>
[[kernel]] void gated_delta_segment_collect_conv_state(
    const device T* mixed [[buffer(0)]],
    const device T* conv_state_in [[buffer(1)]],
    const device bool* mask [[buffer(2)]],
    device T* conv_state_out [[buffer(3)]],
    constant SegmentKernelParams& p [[buffer(4)]],
    uint3 position [[thread_position_in_grid]]) {
  const uint c = position.x;
  const uint r = position.y;
  const uint b = position.z;
  if (c >= p.conv_channels) {
    return;
  }
  const uint rows = p.conv_kernel - 1;
  conv_state_out[(b * rows + r) * p.conv_channels + c] =
      conv_state_entry(p, mixed, conv_state_in, mask, b, r, c, p.tokens);
}

// One thread per (channel, row, checkpoint n * B + batch row b): the conv
// state after checkpoints[n] tokens into conv_checkpoint_states [N, B, K-1, C].
template <typename T>
[[kernel]] void gated_delta_segment_collect_conv_checkpoints(
    const device T* mixed [[buffer(0)]],
    const device T* conv_state_in [[buffer(1)]],
    const device bool* mask [[buffer(2)]],
    const device int* checkpoints [[buffer(3)]],
    device T* conv_checkpoint_states [[buffer(4)]],
    constant SegmentKernelParams& p [[buffer(5)]],
    uint3 position [[thread_position_in_grid]]) {
  const uint c = position.x;
  const uint r = position.y;
  const uint n = position.z / p.batch;
  const uint b = position.z % p.batch;
  if (c >= p.conv_channels) {
    return;
  }
  const uint rows = p.conv_kernel - 1;
  conv_checkpoint_states[((n * p.batch + b) * rows + r) * p.conv_channels + c] =
      conv_state_entry(p, mixed, conv_state_in, mask, b, r, c, uint(checkpoints[n]));
}

instantiate_kernel("gated_delta_segment_collect_conv_state_float32", gated_delta_segment_collect_conv_state, float)
instantiate_kernel("gated_delta_segment_collect_conv_state_float16", gated_delta_segment_collect_conv_state, half)
instantiate_kernel("gated_delta_segment_collect_conv_state_bfloat16", gated_delta_segment_collect_conv_state, bfloat)
instantiate_kernel("gated_delta_segment_collect_conv_checkpoints_float32", gated_delta_segment_collect_conv_checkpoints, float)
instantiate_kernel("gated_delta_segment_collect_conv_checkpoints_float16", gated_delta_segment_collect_conv_checkpoints, half)
instantiate_kernel("gated_delta_segment_collect_conv_checkpoints_bfloat16", gated_delta_segment_collect_conv_checkpoints, bfloat)
