// Shapes and parameters of the fused layer segment (docs/contract.md).
//
// Plain C++ with no backend and no MLX dependency, like core/core_params.h:
// the CPU kernels, the primitive and the op function read the same struct.
#pragma once

#include "core/core_params.h"

namespace mlx_gated_delta {

// Everything that fixes the result of one segment call, except the data.
// Layouts (all row-major, contiguous):
//   mixed_qkvzba [B, T, F] packed per token as [q | k | v | z | b | a]
//   conv_weight  [C, K] (float32)       conv_state [B, K-1, C]
//   decay_parameter, dt_bias [Hv]      norm_weight [Dv] (float32)
//   state [B, Hv, Dv, Dk] (float32)    out [B, T, Hv, Dv]   mask [B, T]
//   checkpoints [N] (int32)  conv_checkpoint_states [N, B, K-1, C]
//   checkpoint_states [N, B, Hv, Dv, Dk] (float32)
// where C = 2*Hk*Dk + Hv*Dv are the channels the convolution sees (q|k|v).
struct SegmentParams : ProblemShape {
  int conv_kernel = 0;
  DecayParameterization decay_parameterization = DecayParameterization::LogRate;
  HeadMapping head_mapping = HeadMapping::Grouped;
  float norm_eps = 1e-6f;
  bool has_mask = false;
  int checkpoint_count = 0;  // N

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
    return a_offset() + value_heads;
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
    core.checkpoint_count = checkpoint_count;
    return core;
  }
};

}  // namespace mlx_gated_delta
