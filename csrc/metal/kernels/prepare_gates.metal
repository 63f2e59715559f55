// prepare_gates: the core's float32 gates from the packed a and b columns,
// g = rate * softplus(a + dt_bias) (log-space decay; rate = -exp(A_log) or
// the negative rate itself), or lower_bound * sigmoid(-rate * (a + dt_bias))
// with a lower bound, per value head or per value head and key channel
// (gate_width); beta = sigmoid(b), times beta_scale. Masked tokens get gates
// too; the core turns them into no-ops.

#include "segment_common.h"

// One thread per (batch, token, value head).
template <typename T>
[[kernel]] void gated_delta_segment_prepare_gates(
    const device T* mixed [[buffer(0)]],
    const device float* decay_parameter [[buffer(1)]],
    const device float* dt_bias [[buffer(2)]],
    device float* g [[buffer(3)]],
    device float* beta [[buffer(4)]],
    constant SegmentKernelParams& p [[buffer(5)]],
    uint index [[thread_position_in_grid]]) {
  if (index >= p.batch * p.tokens * p.value_heads) {
    return;
  }
  const uint h = index % p.value_heads;
  const device T* row = mixed + (index / p.value_heads) * p.mixed_qkvzba_width;
  const float rate = p.log_rate != 0 ? -exp(decay_parameter[h]) : decay_parameter[h];
  // g [B, T, Hv, gate_width]: this head's gate_width values.
  for (uint c = 0; c < p.gate_width; ++c) {
    const uint column = h * p.gate_width + c;
    const float u = float(row[p.a_offset + column]) + dt_bias[column];
    g[index * p.gate_width + c] = p.has_lower_bound != 0
        ? p.lower_bound * segment_sigmoid(-rate * u)
        : rate * segment_softplus(u);
  }
  beta[index] = p.beta_scale * segment_sigmoid(float(row[p.b_offset + h]));
}

instantiate_kernel("gated_delta_segment_prepare_gates_float32", gated_delta_segment_prepare_gates, float)
instantiate_kernel("gated_delta_segment_prepare_gates_float16", gated_delta_segment_prepare_gates, half)
instantiate_kernel("gated_delta_segment_prepare_gates_bfloat16", gated_delta_segment_prepare_gates, bfloat)
