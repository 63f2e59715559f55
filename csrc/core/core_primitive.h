// MLX primitives of mlx-gated-delta.
#pragma once

#include "core/core_params.h"
#include "mlx/primitives.h"

namespace mlx_gated_delta {

// The core recurrence of docs/contract.md.
// Inputs: q, k, v, g (float32), beta (float32), state (float32) [, mask (bool)]
// [, checkpoints (int32, validated)] [, parents (int32, validated)], all
// row-contiguous. Outputs: y
// [B, T, Hv, Dv] in v's dtype, state [B, Hv, Dv, Dk] [, checkpoint states
// [N, B, Hv, Dv, Dk]].
// Carries only what changes the result: its CoreOptions (the requested
// algorithm among them; Auto: eval_cpu and the Metal plan resolve it per
// shape, and the vjp passes it to the backward, which resolves its own). With
// `has_gamma`, one last input follows: the linear decay gamma of which g
// = log(gamma) was taken; the forward does not read it, the vjp gives it the
// gradient of the linear decay (exact where gamma == 0, where the chain rule
// through log would be 0 / 0).
class GatedDeltaRule : public mlx::core::Primitive {
 public:
  GatedDeltaRule(mlx::core::Stream stream, const CoreOptions& options)
      : mlx::core::Primitive(stream), options_(options) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;
  void eval_gpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

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
    return "GatedDeltaRule";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override;
  std::vector<mlx::core::Shape> output_shapes(
      const std::vector<mlx::core::array>& inputs) override;

  // The params of one call, read off the input shapes.
  GatedDeltaParams params_for(
      const std::vector<mlx::core::array>& inputs) const;

 private:
  CoreOptions options_;
};

}  // namespace mlx_gated_delta
