#include "segment/segment_op.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "mlx/ops.h"
#include "segment/segment_params.h"
#include "segment/segment_primitive.h"
#include "validation/arguments.h"

namespace mx = mlx::core;

namespace mlx_gated_delta {

namespace {

void check_positive(const char* name, int value) {
  if (value <= 0) {
    throw std::invalid_argument(std::string(name) + " must be positive, got " +
                                std::to_string(value));
  }
}

}  // namespace

std::vector<mx::array> gated_delta_segment(
    const mx::array& mixed_qkvzba,
    const mx::array& conv_weight,
    const mx::array& decay_parameter,
    const mx::array& dt_bias,
    const mx::array& norm_weight,
    const std::optional<mx::array>& conv_state,
    const std::optional<mx::array>& state,
    int key_heads,
    int value_heads,
    int key_dim,
    int value_dim,
    const std::string& decay_parameterization,
    const std::string& head_mapping,
    float norm_eps,
    const std::optional<mx::array>& mask,
    const std::string& algorithm,
    mx::StreamOrDevice s) {
  SegmentParams p;
  p.decay_parameterization = parse_decay_parameterization(decay_parameterization);
  p.head_mapping = parse_head_mapping(head_mapping);
  const Algorithm requested = parse_algorithm(algorithm);
  p.has_mask = mask.has_value();

  check_positive("key_heads", key_heads);
  check_positive("value_heads", value_heads);
  check_positive("key_dim", key_dim);
  check_positive("value_dim", value_dim);
  if (value_heads % key_heads != 0) {
    throw std::invalid_argument(
        "value_heads (" + std::to_string(value_heads) +
        ") must be a multiple of key_heads (" + std::to_string(key_heads) + ")");
  }
  p.key_heads = key_heads;
  p.value_heads = value_heads;
  p.key_dim = key_dim;
  p.value_dim = value_dim;
  if (!std::isfinite(norm_eps) || norm_eps < 0.0f) {
    throw std::invalid_argument("norm_eps must be finite and >= 0, got " +
                                std::to_string(norm_eps));
  }
  p.norm_eps = norm_eps;

  const mx::Dtype dtype = mixed_qkvzba.dtype();
  if (dtype != mx::float32 && dtype != mx::float16 && dtype != mx::bfloat16) {
    throw std::domain_error(
        "mixed_qkvzba must be float32, float16 or bfloat16, got " +
        dtype_string(dtype));
  }
  if (mixed_qkvzba.ndim() != 3) {
    throw std::invalid_argument(
        "mixed_qkvzba must have rank 3 [B, T, F], got shape " +
        shape_string(mixed_qkvzba.shape()));
  }
  p.batch = mixed_qkvzba.shape(0);
  p.tokens = mixed_qkvzba.shape(1);
  if (mixed_qkvzba.shape(2) != p.packed_width()) {
    std::ostringstream out;
    out << "mixed_qkvzba must have last dimension F = 2*Hk*Dk + 2*Hv*Dv + 2*Hv = "
        << p.packed_width() << " (packed [q | k | v | z | b | a] for Hk="
        << key_heads << ", Hv=" << value_heads << ", Dk=" << key_dim
        << ", Dv=" << value_dim << "), got shape "
        << shape_string(mixed_qkvzba.shape());
    throw std::invalid_argument(out.str());
  }

  // conv_weight: [C, K] or mlx's Conv1d layout [C, K, 1].
  const int C = p.conv_channels();
  const bool conv1d_layout = conv_weight.ndim() == 3 && conv_weight.shape(2) == 1;
  if (!(conv_weight.ndim() == 2 || conv1d_layout) || conv_weight.shape(0) != C ||
      conv_weight.shape(1) < 1) {
    std::ostringstream out;
    out << "conv_weight must have shape (" << C << ", K) or (" << C
        << ", K, 1) (C = 2*Hk*Dk + Hv*Dv channels q|k|v, K >= 1), got "
        << shape_string(conv_weight.shape());
    throw std::invalid_argument(out.str());
  }
  check_floating("conv_weight", conv_weight);
  p.conv_kernel = conv_weight.shape(1);

  check_shape("decay_parameter", decay_parameter, {value_heads}, "[Hv]");
  check_shape("dt_bias", dt_bias, {value_heads}, "[Hv]");
  check_shape("norm_weight", norm_weight, {value_dim}, "[Dv]");
  check_floating("decay_parameter", decay_parameter);
  check_floating("dt_bias", dt_bias);
  check_floating("norm_weight", norm_weight);

  const mx::Shape conv_state_shape = {p.batch, p.conv_state_rows(), C};
  if (conv_state) {
    check_shape("conv_state", *conv_state, conv_state_shape, "[B, K-1, C]");
    if (conv_state->dtype() != dtype) {
      throw std::domain_error(
          "conv_state must have the activation dtype of mixed_qkvzba (" +
          dtype_string(dtype) + "), got " + dtype_string(conv_state->dtype()));
    }
  }
  const mx::Shape state_shape = {p.batch, value_heads, value_dim, key_dim};
  if (state) {
    check_shape("state", *state, state_shape, "[B, Hv, Dv, Dk]");
    if (state->dtype() != mx::float32) {
      throw std::domain_error(
          "state must be float32 (the recurrent state is kept in float32), got " +
          dtype_string(state->dtype()));
    }
  }
  if (mask) {
    check_shape("mask", *mask, {p.batch, p.tokens}, "[B, T]");
    if (mask->dtype() != mx::bool_) {
      throw std::domain_error("mask must be a bool array, got " +
                              dtype_string(mask->dtype()));
    }
  }
  // Before any allocation: the same limits on every backend (API.md section 5).
  validate_launch_extents(p.core_params());
  // The seed's names: the conv's channels (q|k|v), then the packed row.
  check_launch_extent("QKV activation elements",
                      uint64_t(p.batch) * p.tokens * C);
  check_launch_extent("QKVZBA activation elements",
                      uint64_t(p.batch) * p.tokens * p.packed_width());
  check_launch_extent("conv state elements",
                      uint64_t(p.batch) * p.conv_state_rows() * C);

  auto stream = mx::to_stream(s);
  mx::array conv_state_in =
      conv_state ? *conv_state : mx::zeros(conv_state_shape, dtype, stream);
  mx::array state_in =
      state ? *state : mx::zeros(state_shape, mx::float32, stream);
  if (p.tokens == 0) {
    return {mx::zeros({p.batch, 0, value_heads, value_dim}, dtype, stream),
            conv_state_in, state_in};
  }
  // On the GPU the Metal plan resolves "auto" itself.
  const Algorithm resolved =
      (requested == Algorithm::Auto && stream.device == mx::Device::cpu)
      ? resolve_cpu_algorithm(p.core_params())
      : requested;

  // Parameters are small: read them in float32 whatever their dtype.
  auto as_f32 = [&](const mx::array& a) {
    return mx::contiguous(mx::astype(a, mx::float32, stream), false, stream);
  };
  std::vector<mx::array> inputs = {
      mx::contiguous(mixed_qkvzba, false, stream),
      as_f32(mx::reshape(conv_weight, {C, p.conv_kernel}, stream)),
      as_f32(decay_parameter),
      as_f32(dt_bias),
      as_f32(norm_weight),
      mx::contiguous(conv_state_in, false, stream),
      mx::contiguous(state_in, false, stream)};
  if (mask) {
    inputs.push_back(mx::contiguous(*mask, false, stream));
  }
  return mx::array::make_arrays(
      {{p.batch, p.tokens, value_heads, value_dim}, conv_state_shape, state_shape},
      {dtype, dtype, mx::float32},
      std::make_shared<GatedDeltaSegment>(
          stream, key_heads, value_heads, key_dim, value_dim,
          p.decay_parameterization, p.head_mapping, p.norm_eps, p.has_mask,
          resolved),
      inputs);
}

}  // namespace mlx_gated_delta
