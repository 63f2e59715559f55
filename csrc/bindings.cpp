// nanobind module _mlx_gated_delta_ext (re-exported as mlx_gated_delta._ext).
// The Python package wraps these; see mlx_gated_delta/ops.py for the
// documented entry points. Each subject binds its own functions
// (bindings.h).
#include "bindings.h"

#include <stdexcept>

namespace nb = nanobind;
using namespace mlx_gated_delta;

NB_MODULE(_mlx_gated_delta_ext, m) {
  m.doc() =
      "C++ core of mlx_gated_delta (use the functions of mlx_gated_delta).";

  // std::domain_error marks a wrong dtype/type: Python sees TypeError.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::domain_error& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    }
  });

  bind_segment(m);
  bind_core(m);
  bind_test_hooks(m);
}
