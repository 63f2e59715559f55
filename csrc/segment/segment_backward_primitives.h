// The primitive of the segment's backward on the CPU (segment_vjp.cpp): the
// prepare stage (conv, SiLU, gates) recomputed, the core's forward, the gated
// RMSNorm's vjp, the core's backward and the prepare stage's vjp, in one
// kernel call (cpu/segment.h), so that the backward holds the gradients, not
// the float32 temporaries of an MLX op per elementwise step, nor q, k, v and
// y beside them.
#pragma once

#include "mlx/primitives.h"
#include "segment/segment_params.h"

namespace mlx_gated_delta {

// The inputs of GatedDeltaSegmentVJP.
enum SegmentVJPInput {
  kVJPMixed = 0,  // mixed_qkvzba [B, T, F] (activation dtype)
  kVJPConvWeight,  // [C, K] float32
  kVJPDecayParameter,  // [Hv] float32
  kVJPDtBias,  // [Hv] or [Hv, Dk] (per-key gates) float32
  kVJPNormWeight,  // [Dv] float32
  kVJPConvState,  // [B, K-1, C] (activation dtype)
  kVJPState,  // [B, Hv, Dv, Dk] float32, the initial state
  kVJPOutCotangent,  // [B, T, Hv, Dv] (activation dtype), of out
  kVJPConvStateCotangent,  // [B, K-1, C] (activation dtype), of the new one
  kVJPStateCotangent,  // [B, Hv, Dv, Dk] float32, of the final state
  kVJPInputs,  // their count; the mask [B, T] follows, if any
};

// The outputs of GatedDeltaSegmentVJP. The weights' gradients are per batch
// row (the caller sums them, so that vmap folds the mapped axis into the
// batch).
enum SegmentVJPOutput {
  kVJPDMixed = 0,  // [B, T, F] (activation dtype); 0 in a masked token's
                   // q|k|v columns
  kVJPDConvWeightRows,  // [B, C, K] float32
  kVJPDDecayParameterRows,  // [B, Hv] float32
  kVJPDDtBiasRows,  // [B, Hv] or [B, Hv*Dk] float32
  kVJPDNormWeightRows,  // [B, Dv] float32
  kVJPDConvState,  // [B, K-1, C] (activation dtype)
  kVJPDState,  // [B, Hv, Dv, Dk] float32
  kVJPOutputs,  // their count
};

// GatedDeltaSegmentVJP's output dtypes, for the activation dtype.
std::vector<mlx::core::Dtype> segment_vjp_dtypes(mlx::core::Dtype activation);

// The segment's gradient on the CPU (cpu::gated_delta_segment_backward).
// Inputs as SegmentVJPInput [, mask], outputs as SegmentVJPOutput: the
// gradients of the segment at the q, k, v, g and beta its forward computes
// (cpu/segment_stages.h: prepare_conv, prepare_gates), through the core's
// own backward. A masked token's cotangent counts as 0. CPU only.
class GatedDeltaSegmentVJP : public mlx::core::Primitive {
 public:
  // `options`: the segment's params; the batch and the tokens are read off
  // the inputs. `algorithm`: the segment call's, Auto resolved per shape for
  // the core's forward and backward each.
  GatedDeltaSegmentVJP(
      mlx::core::Stream stream,
      const SegmentParams& options,
      Algorithm algorithm)
      : mlx::core::Primitive(stream),
        options_(options),
        algorithm_(algorithm) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;
  void eval_gpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;
  std::pair<std::vector<mlx::core::array>, std::vector<int>> vmap(
      const std::vector<mlx::core::array>& inputs,
      const std::vector<int>& axes) override;

  const char* name() const override {
    return "GatedDeltaSegmentVJP";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override;
  std::vector<mlx::core::Shape> output_shapes(
      const std::vector<mlx::core::array>& inputs) override;

 private:
  SegmentParams options_;
  Algorithm algorithm_;
};

}  // namespace mlx_gated_delta
