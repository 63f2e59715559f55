// The primitives of the segment's backward on the CPU (segment_vjp.cpp): the
// stages up to the core's gradients (the prepare stage recomputed, the core's
// forward, the gated RMSNorm's vjp and the core's backward), then the
// prepare stage's vjp. Each is one kernel call (cpu/segment.h), so the
// backward holds the gradients, not the float32 temporaries of an MLX op per
// elementwise step, nor q, k, v and y beside them.
#pragma once

#include "mlx/primitives.h"
#include "segment/segment_params.h"

namespace mlx_gated_delta {

// The inputs the two primitives share, first; then each one's own.
enum SegmentPrepareInput {
  kPrepareMixed = 0,  // mixed_qkvzba [B, T, F] (activation dtype)
  kPrepareConvWeight,  // [C, K] float32
  kPrepareDecayParameter,  // [Hv] float32
  kPrepareDtBias,  // [Hv] or [Hv, Dk] (per-key gates) float32
  kPrepareConvState,  // [B, K-1, C] (activation dtype)
  kPrepareInputs,  // their count
};
// GatedDeltaSegmentCoreVJP's own inputs.
enum SegmentCoreVJPInput {
  kCoreVJPNormWeight = kPrepareInputs,  // [Dv] float32
  kCoreVJPState,  // [B, Hv, Dv, Dk] float32, the initial state
  kCoreVJPOutCotangent,  // [B, T, Hv, Dv] (activation dtype), of out
  kCoreVJPStateCotangent,  // [B, Hv, Dv, Dk] float32, of the final state
  kCoreVJPInputs,  // their count; the mask [B, T] follows, if any
};
// GatedDeltaSegmentPrepareVJP's own inputs, kPrepareCotangentCount from
// kPrepareInputs on: dq [B, T, Hk, Dk], dk, dv [B, T, Hv, Dv], dg (as g),
// dbeta [B, T, Hv] (float32), the gated norm's dz [B, T, Hv*Dv] and the
// cotangent of the new conv state [B, K-1, C] (both in the activation
// dtype); the mask [B, T] follows, if any.
constexpr int kPrepareCotangentCount = 7;

// The segment's backward up to the core's gradients
// (cpu::gated_delta_segment_core_backward). Inputs as SegmentPrepareInput
// and SegmentCoreVJPInput [, mask]. Outputs, float32 but dz: dq
// [B, T, Hk, Dk], dk, dv [B, T, Hv, Dv], dg [B, T, Hv] (or [B, T, Hv, Dk]
// with per-key gates), dbeta [B, T, Hv], dstate [B, Hv, Dv, Dk]; the gated
// norm's dz [B, T, Hv*Dv] (activation dtype) and d norm_weight per batch row
// [B, Dv] (the caller sums it, so that vmap folds the mapped axis into the
// batch). The gradients are the core's (gated_delta_rule's vjp) at the q, k,
// v, g and beta the segment's forward computes (cpu/segment_stages.h:
// prepare_conv, prepare_gates). A masked token's cotangent counts as 0.
// CPU only.
class GatedDeltaSegmentCoreVJP : public mlx::core::Primitive {
 public:
  // `options`: the segment's params; the batch and the tokens are read off
  // the inputs. `algorithm`: the segment call's, Auto resolved per shape for
  // the core's forward and backward each.
  GatedDeltaSegmentCoreVJP(
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
    return "GatedDeltaSegmentCoreVJP";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override;
  std::vector<mlx::core::Shape> output_shapes(
      const std::vector<mlx::core::array>& inputs) override;

 private:
  SegmentParams options_;
  Algorithm algorithm_;
};

// GatedDeltaSegmentCoreVJP's output dtypes, for the activation dtype.
std::vector<mlx::core::Dtype> segment_core_vjp_dtypes(
    mlx::core::Dtype activation);

// The prepare stage's vjp. Inputs as SegmentPrepareInput, then the
// cotangents (kPrepareCotangentCount) [, mask]. Outputs: d mixed_qkvzba [B, T,
// F] (activation dtype; its z columns are the given dz), and per batch row
// (summed by the caller, so that vmap folds the mapped axis into the batch) d
// conv_weight [B, C, K], d decay_parameter [B, Hv] and d dt_bias [B, Hv] or [B,
// Hv*Dk] (float32); and d conv_state [B, K-1, C] (activation dtype). A masked
// token's packed conv columns get 0. CPU only.
class GatedDeltaSegmentPrepareVJP : public mlx::core::Primitive {
 public:
  GatedDeltaSegmentPrepareVJP(
      mlx::core::Stream stream, const SegmentParams& options)
      : mlx::core::Primitive(stream), options_(options) {}

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
    return "GatedDeltaSegmentPrepareVJP";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override;
  std::vector<mlx::core::Shape> output_shapes(
      const std::vector<mlx::core::array>& inputs) override;

 private:
  SegmentParams options_;
};

}  // namespace mlx_gated_delta
