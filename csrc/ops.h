// Op functions: validate (API.md section 5) and build the graph.
#pragma once

#include <optional>
#include <string>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mlx_gated_delta {

// API.md section 1. Returns {y, state}.
std::vector<mlx::core::array> gated_delta_rule(
    const mlx::core::array& q,
    const mlx::core::array& k,
    const mlx::core::array& v,
    const mlx::core::array& g,
    const mlx::core::array& beta,
    const std::optional<mlx::core::array>& state,
    std::optional<float> scale,
    const std::string& head_mapping,
    const std::optional<mlx::core::array>& mask,
    bool normalize_qk,
    const std::string& algorithm,
    mlx::core::StreamOrDevice s = {});

}  // namespace mlx_gated_delta
