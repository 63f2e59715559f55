// The parts of the nanobind module _mlx_gated_delta_ext, by subject; the
// module (bindings.cpp) calls each once.
#pragma once

#include <nanobind/nanobind.h>

namespace mlx_gated_delta {

// gated_delta_rule, the core op (core/core_bindings.cpp).
void bind_core(nanobind::module_& m);
// gated_delta_segment and dense_projection, the fused layer's ops
// (segment/segment_bindings.cpp).
void bind_segment(nanobind::module_& m);
// What only the tests call: the dispatch choices, the kernels run on guarded
// buffers, the chunked form's stages, the thread pool, the segment's waves and
// the Metal library's hooks (test_hooks.cpp).
void bind_test_hooks(nanobind::module_& m);

}  // namespace mlx_gated_delta
