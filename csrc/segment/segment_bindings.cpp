// nanobind binding of the fused layer segment; bindings.cpp calls
// bind_segment(m). The documented entry point is mlx_gated_delta/segment.py.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "projection/projection_op.h"
#include "segment/segment_op.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlx_gated_delta {

void bind_segment(nb::module_& m) {
  m.def(
      "gated_delta_segment",
      [](const mlx::core::array& mixed_qkvzba,
         const mlx::core::array& conv_weight,
         const mlx::core::array& decay_parameter,
         const mlx::core::array& dt_bias,
         const mlx::core::array& norm_weight,
         const std::optional<mlx::core::array>& conv_state,
         const std::optional<mlx::core::array>& state,
         int key_heads,
         int value_heads,
         int key_dim,
         int value_dim,
         const std::string& decay_parameterization,
         const std::string& head_mapping,
         float norm_eps,
         const std::optional<mlx::core::array>& mask,
         const std::string& algorithm,
         mlx::core::StreamOrDevice s,
         const std::optional<mlx::core::array>& checkpoints,
         std::optional<float> lower_bound,
         bool allow_neg_eigval,
         const std::string& output_gate) {
        auto outputs = gated_delta_segment(
            mixed_qkvzba,
            conv_weight,
            decay_parameter,
            dt_bias,
            norm_weight,
            conv_state,
            state,
            key_heads,
            value_heads,
            key_dim,
            value_dim,
            decay_parameterization,
            head_mapping,
            norm_eps,
            mask,
            algorithm,
            s,
            checkpoints,
            lower_bound,
            allow_neg_eigval,
            output_gate);
        return checkpoints
            ? nb::make_tuple(
                  outputs[0], outputs[1], outputs[2], outputs[3], outputs[4])
            : nb::make_tuple(outputs[0], outputs[1], outputs[2]);
      },
      "mixed_qkvzba"_a,
      "conv_weight"_a,
      "decay_parameter"_a,
      "dt_bias"_a,
      "norm_weight"_a,
      "conv_state"_a.none(),
      "state"_a.none(),
      "key_heads"_a,
      "value_heads"_a,
      "key_dim"_a,
      "value_dim"_a,
      "decay_parameterization"_a,
      "head_mapping"_a,
      "norm_eps"_a,
      "mask"_a.none(),
      "algorithm"_a,
      "stream"_a.none(),
      "checkpoints"_a.none() = nb::none(),
      "lower_bound"_a.none() = nb::none(),
      "allow_neg_eigval"_a = false,
      "output_gate"_a = "silu");
  m.def(
      "dense_projection",
      [](const mlx::core::array& x,
         const mlx::core::array& weight,
         mlx::core::StreamOrDevice s) {
        return dense_projection(x, weight, s);
      },
      "x"_a,
      "weight"_a,
      "stream"_a.none(),
      "x @ weight.T on the CPU (the layer's dense projections).");
  m.def(
      "dense_projection_row",
      [](const std::vector<mlx::core::array>& xs,
         const std::vector<mlx::core::array>& weights,
         mlx::core::StreamOrDevice s) {
        return dense_projection_row(xs, weights, s);
      },
      "xs"_a,
      "weights"_a,
      "stream"_a.none(),
      "concatenate([x @ w.T for x, w in zip(xs, weights)], axis=-1) on the "
      "CPU, written into one buffer.");
}

}  // namespace mlx_gated_delta
