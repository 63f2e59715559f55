#include "validation/extents.h"

#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

namespace mlx_gated_delta {

void check_launch_extent(const char* what, uint64_t elements) {
  constexpr uint64_t kMax = std::numeric_limits<uint32_t>::max();
  if (elements > kMax) {
    std::ostringstream message;
    message << what << " (" << elements
            << ") exceed the 32-bit index range of a GPU kernel (at most "
            << kMax << ")";
    throw std::invalid_argument(message.str());
  }
}

void validate_launch_extents(const GatedDeltaParams& p) {
  const uint64_t b = p.batch, t = p.tokens;
  check_launch_extent(
      "QK activation elements", b * t * uint64_t(p.key_heads) * p.key_dim);
  check_launch_extent(
      "V activation elements", b * t * uint64_t(p.value_heads) * p.value_dim);
  check_launch_extent(
      "gate elements", b * t * uint64_t(p.value_heads) * p.gate_width());
  check_launch_extent(
      "state elements",
      b * uint64_t(p.value_heads) * p.value_dim * uint64_t(p.key_dim));
}

void validate_segment_extents(const SegmentParams& p) {
  // The conv's channels (q|k|v), then the packed row, then the conv state.
  const uint64_t b = p.batch, t = p.tokens, channels = p.conv_channels();
  check_launch_extent("QKV activation elements", b * t * channels);
  check_launch_extent(
      "QKVZBA activation elements", b * t * uint64_t(p.mixed_qkvzba_width()));
  check_launch_extent(
      "conv state elements", b * uint64_t(p.conv_state_rows()) * channels);
}

void validate_plan_shape(const GatedDeltaParams& params) {
  validate_launch_extents(params);
  if (params.key_heads <= 0 || params.value_heads % params.key_heads != 0) {
    throw std::invalid_argument("value_heads must be a multiple of key_heads");
  }
}

void validate_segment_plan_shape(const SegmentParams& params) {
  if (params.conv_kernel < 1) {
    throw std::invalid_argument(
        "the conv kernel needs at least one tap, got " +
        std::to_string(params.conv_kernel));
  }
  validate_segment_extents(params);
}

}  // namespace mlx_gated_delta
