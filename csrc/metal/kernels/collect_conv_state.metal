// collect_conv_state: the new conv state, the last K - 1 pre-conv inputs of
// each batch row that the conv saw: its carried conv state (oldest first),
// then the call's unmasked tokens. Copied in the activation dtype, exactly.

#include "segment_common.h"

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
  // Row r is the (rows - r)-th newest input: walk back over the call's
  // unmasked tokens; when they run out, it is a row of the carried state.
  uint wanted = rows - r;
  int token = int(p.tokens) - 1;
  for (; token >= 0; --token) {
    if (segment_token_is_kept(p, mask, b, uint(token))) {
      --wanted;
      if (wanted == 0) {
        break;
      }
    }
  }
  const uint destination = (b * rows + r) * p.conv_channels + c;
  if (token >= 0) {
    conv_state_out[destination] = mixed[(b * p.tokens + uint(token)) * p.packed_width + c];
  } else {
    conv_state_out[destination] = conv_state_in[(b * rows + rows - wanted) * p.conv_channels + c];
  }
}

instantiate_kernel("gated_delta_segment_collect_conv_state_float32", gated_delta_segment_collect_conv_state, float)
instantiate_kernel("gated_delta_segment_collect_conv_state_float16", gated_delta_segment_collect_conv_state, half)
instantiate_kernel("gated_delta_segment_collect_conv_state_bfloat16", gated_delta_segment_collect_conv_state, bfloat)
