// The op function of the core recurrence: validate (validation/arguments.h),
// then build the graph.
#pragma once

#include <optional>
#include <string>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "validation/arguments.h"

namespace mlx_gated_delta {

// The core recurrence (docs/contract.md). Returns {y, state}, and with
// checkpoints {y, state, checkpoint states}. `gamma`: the
// MLX-compatible entry point's gamma, of which `g` is log(gamma) with its
// gradient stopped; the gradient of the linear decay reaches gamma directly
// through it.
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
    const std::optional<mlx::core::array>& checkpoints = std::nullopt,
    const std::optional<mlx::core::array>& parents = std::nullopt,
    const std::optional<mlx::core::array>& gamma = std::nullopt);

}  // namespace mlx_gated_delta
