// The checks made on a shape, without MLX: the 32-bit extents every GPU
// kernel indexes with and what a Metal plan needs before it allocates. The
// op functions run them after their argument checks (validation/arguments.h),
// the plans before they build, so the same limits hold on every backend.
// Failures throw std::invalid_argument naming the extent.
#pragma once

#include <cstdint>

#include "core/core_params.h"
#include "segment/segment_params.h"

namespace mlx_gated_delta {

// Throws when `elements` does not fit a 32-bit kernel index, naming `what`
// (e.g. "QKV activation elements").
void check_launch_extent(const char* what, uint64_t elements);

// The core's buffers: q/k, v, the gates and the state.
void validate_launch_extents(const GatedDeltaParams& params);

// The segment's own buffers: q|k|v after the conv, the packed input, the
// conv state (validate_launch_extents covers the core's).
void validate_segment_extents(const SegmentParams& params);

// What every core plan checks: the extents and a key head for every value head.
void validate_plan_shape(const GatedDeltaParams& params);

// What every segment plan checks besides its core's: at least one conv tap
// and the segment's extents.
void validate_segment_plan_shape(const SegmentParams& params);

}  // namespace mlx_gated_delta
