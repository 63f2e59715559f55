// The MLX primitive of the fused layer segment (docs/contract.md).
#pragma once

#include "mlx/primitives.h"
#include "segment/segment_params.h"

namespace mlx_gated_delta {

// The order of the segment primitive's inputs (segment_op.cpp builds them).
enum SegmentInput {
  kMixedQkvzba = 0,
  kConvWeight,
  kDecayParameter,
  kDtBias,
  kNormWeight,
  kConvState,
  kState,
  kMask
};

// Inputs: mixed_qkvzba [B, T, F], conv_weight [C, K] (float32),
// decay_parameter [Hv] (float32), dt_bias [Hv] or [Hv, Dk] (float32),
// norm_weight [Dv] (float32), conv_state [B, K-1, C] (activation dtype), state
// [B, Hv, Dv, Dk] (float32) [, mask [B, T] (bool)] [, checkpoints [N] (int32,
// validated)], all row-contiguous. Outputs: out [B, T, Hv, Dv] (activation
// dtype), conv_state, state [, conv checkpoint states [N, B, K-1, C],
// checkpoint states [N, B, Hv, Dv, Dk]]. Carries the head layout (not
// recoverable from mixed_qkvzba's width alone) and the options that change the
// result.
class GatedDeltaSegment : public mlx::core::Primitive {
 public:
  GatedDeltaSegment(
      mlx::core::Stream stream,
      int key_heads,
      int value_heads,
      int key_dim,
      int value_dim,
      DecayParameterization decay_parameterization,
      HeadMapping head_mapping,
      float norm_eps,
      bool has_mask,
      Algorithm algorithm,
      bool has_checkpoints = false,
      SegmentGateOptions gates = {})
      : mlx::core::Primitive(stream),
        key_heads_(key_heads),
        value_heads_(value_heads),
        key_dim_(key_dim),
        value_dim_(value_dim),
        decay_parameterization_(decay_parameterization),
        head_mapping_(head_mapping),
        norm_eps_(norm_eps),
        has_mask_(has_mask),
        algorithm_(algorithm),
        has_checkpoints_(has_checkpoints),
        gates_(gates) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;
  void eval_gpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  // In segment_vjp.cpp: the gradient of every input, through the core op's
  // backward.
  std::vector<mlx::core::array> vjp(
      const std::vector<mlx::core::array>& primals,
      const std::vector<mlx::core::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mlx::core::array>& outputs) override;
  std::vector<mlx::core::array> jvp(
      const std::vector<mlx::core::array>& primals,
      const std::vector<mlx::core::array>& tangents,
      const std::vector<int>& argnums) override;
  std::pair<std::vector<mlx::core::array>, std::vector<int>> vmap(
      const std::vector<mlx::core::array>& inputs,
      const std::vector<int>& axes) override;

  const char* name() const override {
    return "GatedDeltaSegment";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override;
  std::vector<mlx::core::Shape> output_shapes(
      const std::vector<mlx::core::array>& inputs) override;

  // The params of one call, read off the input shapes.
  SegmentParams params_for(const std::vector<mlx::core::array>& inputs) const;

 private:
  int key_heads_;
  int value_heads_;
  int key_dim_;
  int value_dim_;
  DecayParameterization decay_parameterization_;
  HeadMapping head_mapping_;
  float norm_eps_;
  bool has_mask_;
  Algorithm algorithm_;
  bool has_checkpoints_;
  SegmentGateOptions gates_;
};

}  // namespace mlx_gated_delta
