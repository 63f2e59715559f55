// Op functions: validate (API.md section 5) and build the graph.
#pragma once

#include <optional>
#include <string>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mlx_gated_delta {

// How error messages name the gate and the state: the MLX-compatible entry
// point calls them gamma and initial_state (and passes log(gamma) as g).
struct CoreArgumentNames {
  std::string g = "g";
  std::string state = "state";
};

// API.md section 1. Returns {y, state}. `linear_gate`: the MLX-compatible
// entry point's gamma, of which `g` is log(gamma) with its gradient stopped;
// the gradient of the linear decay reaches gamma directly through it.
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
    mlx::core::StreamOrDevice s = {},
    const CoreArgumentNames& names = {},
    const std::optional<mlx::core::array>& linear_gate = std::nullopt);

}  // namespace mlx_gated_delta
