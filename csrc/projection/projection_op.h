// The dense projections of the layer on the CPU (see projection_cpu.h): an
// MLX primitive and its op functions.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlx_gated_delta {

// Inputs: n pairs x_i [..., in_i] and weight_i [out_i, in_i] (x_0, weight_0,
// x_1, ...), every x_i with the same leading shape, one activation dtype,
// contiguous. Output: the x_i weight_i^T side by side, [..., sum of out_i],
// in that dtype: a layer's projections written straight into the packed row
// its segment reads, with no copy of each projection's output on the way.
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

  // dx_i = dy_i W_i and dW_i = dy_i^T x_i, both through this kernel again,
  // dy_i the columns of pair i (a view).
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

// concatenate([x_i weight_i^T for each i], axis=-1) in one buffer, each
// element the bits dense_projection(x_i, weight_i) gives it. Raises as
// dense_projection, and std::invalid_argument where the lists are empty or
// differ in length, or the x_i differ in leading shape.
mlx::core::array dense_projection_row(
    const std::vector<mlx::core::array>& xs,
    const std::vector<mlx::core::array>& weights,
    mlx::core::StreamOrDevice s = {});

}  // namespace mlx_gated_delta
