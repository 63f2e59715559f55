// The dense projection of the layer on the CPU (see projection_cpu.h): an MLX
// primitive and its op function.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlx_gated_delta {

// Inputs: x [..., in] and weight [out, in], one activation dtype, contiguous.
// Output: x weight^T, [..., out], in that dtype.
class DenseProjection : public mlx::core::Primitive {
 public:
  explicit DenseProjection(mlx::core::Stream stream)
      : mlx::core::Primitive(stream) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;
  void eval_gpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override;

  // dx = dy W and dW = dy^T x, both through this kernel again.
  std::vector<mlx::core::array> vjp(
      const std::vector<mlx::core::array>& primals,
      const std::vector<mlx::core::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mlx::core::array>& outputs) override;

  const char* name() const override {
    return "DenseProjection";
  }
  bool is_equivalent(const mlx::core::Primitive&) const override {
    return true;
  }
  std::vector<mlx::core::Shape> output_shapes(
      const std::vector<mlx::core::array>& inputs) override;
};

// y = x weight^T (nn.Linear without bias) on the CPU stream. Raises
// std::invalid_argument / std::domain_error for mismatched shapes or dtypes.
mlx::core::array dense_projection(
    const mlx::core::array& x,
    const mlx::core::array& weight,
    mlx::core::StreamOrDevice s = {});

}  // namespace mlx_gated_delta
