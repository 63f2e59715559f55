// The primitives of the segment's backward on the CPU (segment_vjp.cpp): the
// prepare stage (conv, SiLU, gates) recomputed into the core's inputs, its
// vjp, and the gated RMSNorm's vjp. Each is one fused kernel (cpu/segment.h),
// so the backward holds q, k, v, g, beta, y and their gradients, not the
// float32 temporaries of an MLX op per elementwise step.
#pragma once

#include "mlx/primitives.h"
#include "segment/segment_params.h"

namespace mlx_gated_delta {

// The order of the prepare stage's inputs; the vjp's inputs continue with
// kPrepareCotangents.
enum SegmentPrepareInput {
  kPrepareMixed = 0,  // mixed_qkvzba [B, T, F] (activation dtype)
  kPrepareConvWeight,  // [C, K] float32
  kPrepareDecayParameter,  // [Hv] float32
  kPrepareDtBias,  // [Hv] or [Hv, Dk] (per-key gates) float32
  kPrepareConvState,  // [B, K-1, C] (activation dtype)
  // The vjp's: dq [B, T, Hk, Dk], dk, dv [B, T, Hv, Dv], dg (as g), dbeta
  // [B, T, Hv] (float32), the gated norm's dz [B, T, Hv*Dv] and the cotangent
  // of the new conv state [B, K-1, C] (both in the activation dtype).
  kPrepareCotangents,
};
constexpr int kPrepareCotangentCount = 7;

// Outputs q [B, T, Hk, Dk], k, v [B, T, Hv, Dv], g [B, T, Hv] (or
// [B, T, Hv, Dk] with per-key gates), beta [B, T, Hv], float32,
// exactly as the segment's forward computes them (cpu/segment_stages.h:
// prepare_conv, prepare_gates); a masked token's q, k, v are 0. Inputs as
// SegmentPrepareInput [, mask [B, T]]. CPU only.
class GatedDeltaSegmentPrepare : public mlx::core::Primitive {
 public:
  // `options`: the segment's params; the batch and the tokens are read off
  // the inputs.
  GatedDeltaSegmentPrepare(
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
    return "GatedDeltaSegmentPrepare";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override;
  std::vector<mlx::core::Shape> output_shapes(
      const std::vector<mlx::core::array>& inputs) override;

 private:
  SegmentParams options_;
};

// The prepare stage's vjp. Inputs as SegmentPrepareInput, then the
// cotangents [, mask]. Outputs: d mixed_qkvzba [B, T, F] (activation dtype;
// its z columns are the given dz), and per batch row (summed by the caller,
// so that vmap folds the mapped axis into the batch) d conv_weight
// [B, C, K], d decay_parameter [B, Hv] and d dt_bias [B, Hv] or [B, Hv*Dk]
// (float32); and d conv_state [B, K-1, C] (activation dtype). A masked token's
// packed conv columns get 0. CPU only.
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

// Inputs: y [B, T, Hv, Dv] (float32, the core's output), mixed_qkvzba
// [B, T, F] (its z columns are read), norm_weight [Dv] (float32), the
// cotangent of out [B, T, Hv, Dv] (activation dtype) [, mask [B, T]].
// Outputs: dy [B, T, Hv, Dv] (float32), dz [B, T, Hv*Dv] (activation dtype)
// and d norm_weight per batch row [B, Dv] (float32; the caller sums it, so
// that vmap folds the mapped axis into the batch). A masked token's
// cotangent counts as 0. CPU only.
class GatedDeltaSegmentNormVJP : public mlx::core::Primitive {
 public:
  GatedDeltaSegmentNormVJP(
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
    return "GatedDeltaSegmentNormVJP";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override;
  std::vector<mlx::core::Shape> output_shapes(
      const std::vector<mlx::core::array>& inputs) override;

 private:
  SegmentParams options_;
};

}  // namespace mlx_gated_delta
