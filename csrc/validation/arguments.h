// The argument checks of the op functions, all of them (docs/contract.md,
// "Errors"): messages name the argument, the expected and the actual shape or
// dtype. Wrong values throw std::invalid_argument (Python: ValueError); wrong
// types throw std::domain_error, which the bindings turn into TypeError. Each
// op's checks end with the extents of validation/extents.h, before any
// allocation.
#pragma once

#include <optional>
#include <string>

#include "core/core_params.h"
#include "mlx/array.h"
#include "segment/segment_params.h"

namespace mlx_gated_delta {

std::string shape_string(const mlx::core::Shape& shape);
std::string dtype_string(mlx::core::Dtype dtype);

void check_rank(
    const std::string& name,
    const mlx::core::array& a,
    int rank,
    const char* layout);
void check_shape(
    const std::string& name,
    const mlx::core::array& a,
    const mlx::core::Shape& expected,
    const char* layout);
void check_floating(const std::string& name, const mlx::core::array& a);

// float32, float16 or bfloat16: the activation dtypes the kernels read.
bool is_activation_dtype(mlx::core::Dtype dtype);
void check_activation_dtype(const std::string& name, const mlx::core::array& a);

// A recurrent state: the given shape, float32.
void check_state(
    const std::string& name,
    const mlx::core::array& state,
    const mlx::core::Shape& shape);
// A mask: [B, T], bool.
void check_mask(const mlx::core::array& mask, int batch, int tokens);

// How error messages name the gate and the state: the MLX-compatible entry
// point calls them gamma and initial_state (and passes log(gamma) as g).
struct CoreArgumentNames {
  std::string g = "g";
  std::string state = "state";
};

// The arrays of one core op call, as the op received them.
struct CoreArrays {
  const mlx::core::array &q, &k, &v, &g, &beta;
  const std::optional<mlx::core::array>&state, &mask;
};

// Every check of the core op's arguments; fills the shape and the scale of
// `params` (the default scale is Dk ** -0.5).
void check_core_arguments(
    GatedDeltaParams& params,
    const CoreArrays& arrays,
    std::optional<float> scale,
    const CoreArgumentNames& names);

// The arrays of one segment op call, as the op received them.
struct SegmentArrays {
  const mlx::core::array &mixed_qkvzba, &conv_weight, &decay_parameter,
      &dt_bias, &norm_weight;
  const std::optional<mlx::core::array>&conv_state, &state, &mask;
};

// Every check of the segment op's arguments; fills the shape (from the
// packed input and `heads`), conv_kernel and norm_eps of `params`.
void check_segment_arguments(
    SegmentParams& params,
    const SegmentArrays& arrays,
    const ProblemShape& heads,
    float norm_eps);

}  // namespace mlx_gated_delta
