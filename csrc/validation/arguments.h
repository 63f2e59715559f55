// Argument checks shared by the op functions (API.md section 5): messages name
// the argument, the expected and the actual shape or dtype. Wrong values throw
// std::invalid_argument (Python: ValueError); wrong types throw
// std::domain_error, which the bindings turn into TypeError.
#pragma once

#include <string>

#include "mlx/array.h"

namespace mlx_gated_delta {

std::string shape_string(const mlx::core::Shape& shape);
std::string dtype_string(mlx::core::Dtype dtype);

void check_rank(const std::string& name, const mlx::core::array& a, int rank,
                const char* layout);
void check_shape(const std::string& name, const mlx::core::array& a,
                 const mlx::core::Shape& expected, const char* layout);
void check_floating(const std::string& name, const mlx::core::array& a);

// float32, float16 or bfloat16: the activation dtypes the kernels read.
bool is_activation_dtype(mlx::core::Dtype dtype);
void check_activation_dtype(const std::string& name, const mlx::core::array& a);

}  // namespace mlx_gated_delta
