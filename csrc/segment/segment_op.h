// The op function of the fused layer segment: validate, then build the graph.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mlx_gated_delta {

// docs/contract.md. Returns {out, conv_state, state}. `lower_bound`,
// `allow_neg_eigval` and `output_gate` ("silu" or "sigmoid") are the gate
// variants of SegmentGateOptions; the defaults are the Qwen layout's.
// Bad input raises std::invalid_argument (ValueError in Python) or
// std::domain_error (TypeError) naming the argument, before any allocation.
std::vector<mlx::core::array> gated_delta_segment(
    const mlx::core::array& mixed_qkvzba,
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
    mlx::core::StreamOrDevice s = {},
    const std::optional<mlx::core::array>& checkpoints = std::nullopt,
    std::optional<float> lower_bound = std::nullopt,
    bool allow_neg_eigval = false,
    const std::string& output_gate = "silu");

// Test hook: run the segment as MLX ops around the core op on every stream
// (segment_ops.h), the composition its backward differentiates off the CPU,
// instead of its primitive (the tests and the CUDA benchmark compare them).
void set_segment_as_ops_on_every_stream(bool on);

}  // namespace mlx_gated_delta
