#include "validation/arguments.h"

#include <sstream>
#include <stdexcept>

#include "mlx/utils.h"

namespace mx = mlx::core;

namespace mlx_gated_delta {

std::string shape_string(const mx::Shape& shape) {
  std::ostringstream out;
  out << '(';
  for (size_t i = 0; i < shape.size(); ++i) {
    out << (i ? ", " : "") << shape[i];
  }
  out << (shape.size() == 1 ? ",)" : ")");
  return out.str();
}

std::string dtype_string(mx::Dtype dtype) {
  std::ostringstream out;
  out << dtype;
  return out.str();
}

void check_rank(const std::string& name, const mx::array& a, int rank,
                const char* layout) {
  if (static_cast<int>(a.ndim()) != rank) {
    std::ostringstream out;
    out << name << " must have rank " << rank << " " << layout << ", got shape "
        << shape_string(a.shape()) << " (rank " << a.ndim() << ")";
    throw std::invalid_argument(out.str());
  }
}

void check_shape(const std::string& name, const mx::array& a,
                 const mx::Shape& expected, const char* layout) {
  if (a.shape() != expected) {
    std::ostringstream out;
    out << name << " must have shape " << shape_string(expected) << " " << layout
        << ", got " << shape_string(a.shape());
    throw std::invalid_argument(out.str());
  }
}

void check_floating(const std::string& name, const mx::array& a) {
  if (!mx::issubdtype(a.dtype(), mx::floating)) {
    throw std::domain_error(
        name + " must be a floating-point array, got " + dtype_string(a.dtype()));
  }
}

bool is_activation_dtype(mx::Dtype dtype) {
  return dtype == mx::float32 || dtype == mx::float16 || dtype == mx::bfloat16;
}

void check_activation_dtype(const std::string& name, const mx::array& a) {
  if (!is_activation_dtype(a.dtype())) {
    throw std::domain_error(
        name + " must be float32, float16 or bfloat16, got " +
        dtype_string(a.dtype()));
  }
}

}  // namespace mlx_gated_delta
