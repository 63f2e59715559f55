// The backward (vjp) of the core gated-delta op as an MLX primitive, so that
// mx.compile and the graph hold it like any other.
#pragma once

#include "core/core_params.h"
#include "mlx/primitives.h"

namespace mlx_gated_delta {

// Inputs: q, k, v, g, beta, state [, mask], then the cotangents of y (in v's
// dtype) and of the final state (float32), all row-contiguous: the forward's
// inputs, so the backward recomputes what it needs (see
// cpu/recurrent_backward.cpp). Outputs: dq, dk, dv (in their inputs' dtypes),
// dg, dgamma (the gradient of the linear decay exp(g)), dbeta and dstate,
// float32. `options.algorithm` picks the backward's form: Recurrent, Chunked,
// or Auto (the CPU resolves it per shape, resolve_cpu_backward_algorithm in
// core/dispatch.h; Metal through resolve_metal_backward_algorithm).
class GatedDeltaRuleVJP : public mlx::core::Primitive {
 public:
  // `options` as the forward's, without checkpoints, tree or gamma
  // (none of them is an input of the backward).
  GatedDeltaRuleVJP(mlx::core::Stream stream, const CoreOptions& options)
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
    return "GatedDeltaRuleVJP";
  }
  bool is_equivalent(const mlx::core::Primitive& other) const override;
  std::vector<mlx::core::Shape> output_shapes(
      const std::vector<mlx::core::array>& inputs) override;

 private:
  GatedDeltaParams params_for(
      const std::vector<mlx::core::array>& inputs) const;

  CoreOptions options_;
};

// GatedDeltaRule's vjp: the gradients of the requested primals. `primals`
// are the forward primitive's inputs: q, k, v, g, beta, state [, mask]
// [, gamma]; the optional gamma (gated_delta_update's linear decay, of
// which g = log(gamma) is the unread-for-gradient copy) receives the
// gradient of the linear decay, finite and exact where gamma == 0.
// `options` are the forward call's (its algorithm the one it asked for, Auto
// unless explicit).
std::vector<mlx::core::array> gated_delta_rule_vjp(
    mlx::core::Stream stream,
    const CoreOptions& options,
    const std::vector<mlx::core::array>& primals,
    const std::vector<mlx::core::array>& cotangents,
    const std::vector<int>& argnums);

}  // namespace mlx_gated_delta
