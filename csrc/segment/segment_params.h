// Shapes and parameters of the fused layer segment (docs/contract.md).
//
// Plain C++ with no backend and no MLX dependency, like core/core_params.h:
// the CPU kernels, the primitive and the op function read the same struct.
#pragma once

#include "core/core_params.h"

namespace mlx_gated_delta {

// What multiplies the normed output: silu(z) (the Qwen and OLMo-Hybrid
// layers) or sigmoid(z) (Kimi Delta Attention's o_norm(y) * sigmoid(gate)).
enum class OutputGate { Silu, Sigmoid };

// The gate variants of the mlx-lm families, beside the Qwen layout's
// defaults (docs/contract.md):
//   lower_bound (has_lower_bound): g = lower_bound * sigmoid(-rate *
//     (a + dt_bias)), in [lower_bound, 0], instead of rate * softplus(a +
//     dt_bias);
//   allow_neg_eigval: beta = 2 sigmoid(b), in [0, 2];
//   output_gate: see OutputGate.
// Whether the gates are per key channel is read off dt_bias's shape
// (SegmentParams::per_key_gates).
struct SegmentGateOptions {
  bool has_lower_bound = false;
  float lower_bound = 0.0f;
  bool allow_neg_eigval = false;
  OutputGate output_gate = OutputGate::Silu;

  bool operator==(const SegmentGateOptions&) const = default;
};

// Everything that fixes the result of one segment call, except the data.
// Layouts (all row-major, contiguous):
//   mixed_qkvzba [B, T, F] packed per token as [q | k | v | z | b | a]
//   conv_weight  [C, K] (float32)       conv_state [B, K-1, C]
//   decay_parameter [Hv]   dt_bias [Hv], or [Hv, Dk] with per_key_gates
//   norm_weight [Dv] (float32)
//   state [B, Hv, Dv, Dk] (float32)    out [B, T, Hv, Dv]   mask [B, T]
//   checkpoints [N] (int32)  conv_checkpoint_states [N, B, K-1, C]
//   checkpoint_states [N, B, Hv, Dv, Dk] (float32)
// where C = 2*Hk*Dk + Hv*Dv are the channels the convolution sees (q|k|v)
// and F = C + Hv*Dv + Hv + gate_width() (a is one value per value head, or
// per value head and key channel with per_key_gates).
struct SegmentParams : ProblemShape {
  int conv_kernel = 0;
  DecayParameterization decay_parameterization = DecayParameterization::LogRate;
  HeadMapping head_mapping = HeadMapping::Grouped;
  float norm_eps = 1e-6f;
  bool has_mask = false;
  int checkpoint_count = 0;  // N
  // a, dt_bias and g hold one value per value head and key channel (Kimi
  // Delta Attention's per-key decays): g [B, T, Hv, Dk] into the core.
  bool per_key_gates = false;
  SegmentGateOptions gates;

  // a's (and dt_bias's, g's) values per token: Hv, or Hv*Dk per key channel.
  int gate_width() const {
    return per_key_gates ? value_heads * key_dim : value_heads;
  }

  int qk_width() const {
    return key_heads * key_dim;
  }
  int v_width() const {
    return value_heads * value_dim;
  }
  int conv_channels() const {
    return 2 * qk_width() + v_width();
  }
  int conv_state_rows() const {
    return conv_kernel - 1;
  }
  // Offsets of the parts of one mixed_qkvzba row.
  int z_offset() const {
    return conv_channels();
  }
  int b_offset() const {
    return z_offset() + v_width();
  }
  int a_offset() const {
    return b_offset() + value_heads;
  }
  int mixed_qkvzba_width() const {
    return a_offset() + gate_width();
  }

  // The core recurrence this segment runs: q and k are L2-normalized inside
  // the core and the readout scale is Dk ** -0.5.
  GatedDeltaParams core_params() const {
    GatedDeltaParams core;
    core.set_shape(*this);
    core.scale = default_scale(key_dim);
    core.head_mapping = head_mapping;
    core.normalize_qk = true;
    core.has_mask = has_mask;
    core.per_key_gates = per_key_gates;
    core.checkpoint_count = checkpoint_count;
    return core;
  }
};

}  // namespace mlx_gated_delta
