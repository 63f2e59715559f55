// nanobind binding of the core op (bindings.h); the documented entry point is
// mlx_gated_delta/ops.py.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "bindings.h"
#include "core/core_op.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace mlx_gated_delta {

void bind_core(nb::module_& m) {
  m.def(
      "gated_delta_rule",
      [](const mx::array& q,
         const mx::array& k,
         const mx::array& v,
         const mx::array& g,
         const mx::array& beta,
         const std::optional<mx::array>& state,
         std::optional<float> scale,
         const std::string& head_mapping,
         const std::optional<mx::array>& mask,
         bool normalize_qk,
         const std::string& algorithm,
         mx::StreamOrDevice stream,
         const std::string& g_name,
         const std::string& state_name,
         const std::optional<mx::array>& checkpoints,
         const std::optional<mx::array>& parents,
         const std::optional<mx::array>& gamma) {
        auto out = gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            state,
            scale,
            head_mapping,
            mask,
            normalize_qk,
            algorithm,
            stream,
            CoreArgumentNames{g_name, state_name},
            checkpoints,
            parents,
            gamma);
        return checkpoints ? nb::make_tuple(out[0], out[1], out[2])
                           : nb::make_tuple(out[0], out[1]);
      },
      "q"_a,
      "k"_a,
      "v"_a,
      "g"_a,
      "beta"_a,
      "state"_a.none(),
      "scale"_a.none(),
      "head_mapping"_a,
      "mask"_a.none(),
      "normalize_qk"_a,
      "algorithm"_a,
      "stream"_a.none(),
      "g_name"_a = "g",
      "state_name"_a = "state",
      "checkpoints"_a.none() = nb::none(),
      "parents"_a.none() = nb::none(),
      "gamma"_a.none() = nb::none());
}

}  // namespace mlx_gated_delta
