// The gated RMSNorm's vjp as a primitive of its own, for the segment's
// backward on the CPU (segment_vjp.cpp): one kernel instead of an MLX op per
// elementwise step, each a float32 [B, T, Hv, Dv] temporary.
#pragma once

#include "mlx/primitives.h"
#include "segment/segment_params.h"

namespace mlx_gated_delta {

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
