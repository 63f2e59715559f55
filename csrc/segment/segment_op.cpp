#include "segment/segment_op.h"

#include <atomic>
#include <cmath>
#include <stdexcept>

#include "core/dispatch.h"
#include "mlx/ops.h"
#include "segment/segment_ops.h"
#include "segment/segment_params.h"
#include "segment/segment_primitive.h"
#include "validation/arguments.h"

#ifdef MLX_GATED_DELTA_CUDA
#include "core/cuda_coverage.h"
#include "cuda/executor.h"
#endif

namespace mx = mlx::core;

namespace mlx_gated_delta {

namespace {

// Set by a test hook (test_hooks.cpp) so that the tests, and the CUDA
// benchmark's comparison, run the segment as MLX ops around the core op
// (segment_ops.h), the composition its backward differentiates off the CPU.
std::atomic<bool> segment_as_ops_on_every_stream{false};

SegmentGateOptions parse_gate_options(
    std::optional<float> lower_bound,
    bool allow_neg_eigval,
    const std::string& output_gate) {
  SegmentGateOptions gates;
  if (lower_bound) {
    if (!std::isfinite(*lower_bound) || *lower_bound > 0.0f) {
      throw std::invalid_argument(
          "lower_bound must be finite and <= 0 (the least log decay per "
          "token), got " +
          std::to_string(*lower_bound));
    }
    gates.has_lower_bound = true;
    gates.lower_bound = *lower_bound;
  }
  gates.allow_neg_eigval = allow_neg_eigval;
  if (output_gate == "silu") {
    gates.output_gate = OutputGate::Silu;
  } else if (output_gate == "sigmoid") {
    gates.output_gate = OutputGate::Sigmoid;
  } else {
    throw std::invalid_argument(
        "output_gate must be 'silu' or 'sigmoid', got '" + output_gate + "'");
  }
  return gates;
}

}  // namespace

void set_segment_as_ops_on_every_stream(bool on) {
  segment_as_ops_on_every_stream = on;
}

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
    mx::StreamOrDevice s,
    const std::optional<mx::array>& checkpoints,
    std::optional<float> lower_bound,
    bool allow_neg_eigval,
    const std::string& output_gate) {
  SegmentParams p;
  p.gates = parse_gate_options(lower_bound, allow_neg_eigval, output_gate);
  p.decay_parameterization =
      parse_decay_parameterization(decay_parameterization);
  p.head_mapping = parse_head_mapping(head_mapping);
  const Algorithm requested = parse_algorithm(algorithm);
  p.has_mask = mask.has_value();

  check_segment_arguments(
      p,
      {mixed_qkvzba,
       conv_weight,
       decay_parameter,
       dt_bias,
       norm_weight,
       conv_state,
       state,
       mask},
      {0, 0, key_heads, value_heads, key_dim, value_dim},
      norm_eps);
  std::vector<int> positions;
  if (checkpoints) {
    positions = check_checkpoints(*checkpoints, p.tokens);
    p.checkpoint_count = int(positions.size());
  }
  const mx::Dtype dtype = mixed_qkvzba.dtype();
  const int C = p.conv_channels();
  const mx::Shape conv_state_shape = {p.batch, p.conv_state_rows(), C};
  const mx::Shape state_shape = {p.batch, value_heads, value_dim, key_dim};

  const mx::Stream stream = mx::to_stream(s);
#ifdef MLX_GATED_DELTA_CUDA
  // The segment's own stages cover every shape; its core's kernels may not.
  require_cuda_kernels(
      stream, "gated_delta_segment", cuda::core_kernels_gap(p.core_params()));
#endif
  mx::array conv_state_in =
      conv_state ? *conv_state : mx::zeros(conv_state_shape, dtype, stream);
  mx::array state_in =
      state ? *state : mx::zeros(state_shape, mx::float32, stream);
  if (p.tokens == 0) {  // no checkpoint fits in no tokens
    std::vector<mx::array> empty = {
        mx::zeros({p.batch, 0, value_heads, value_dim}, dtype, stream),
        conv_state_in,
        state_in};
    if (checkpoints) {
      empty.push_back(
          mx::zeros({0, p.batch, p.conv_state_rows(), C}, dtype, stream));
      empty.push_back(mx::zeros(
          {0, p.batch, value_heads, value_dim, key_dim}, mx::float32, stream));
    }
    return empty;
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
  if (segment_as_ops_on_every_stream) {
    return segment_as_ops(
        p,
        requested,
        std::vector<mx::array>(inputs.begin(), inputs.begin() + kMask),
        mask ? std::optional(inputs[kMask]) : std::nullopt,
        positions,
        stream);
  }
  std::vector<mx::Shape> shapes = {
      {p.batch, p.tokens, value_heads, value_dim},
      conv_state_shape,
      state_shape};
  std::vector<mx::Dtype> dtypes = {dtype, dtype, mx::float32};
  if (checkpoints) {
    inputs.push_back(
        mx::array(positions.begin(), {p.checkpoint_count}, mx::int32));
    shapes.push_back({p.checkpoint_count, p.batch, p.conv_state_rows(), C});
    shapes.push_back(
        {p.checkpoint_count, p.batch, value_heads, value_dim, key_dim});
    dtypes.push_back(dtype);
    dtypes.push_back(mx::float32);
  }
  return mx::array::make_arrays(
      shapes,
      dtypes,
      std::make_shared<GatedDeltaSegment>(
          stream,
          key_heads,
          value_heads,
          key_dim,
          value_dim,
          p.decay_parameterization,
          p.head_mapping,
          p.norm_eps,
          p.has_mask,
          resolved,
          checkpoints.has_value(),
          p.gates),
      inputs);
}

}  // namespace mlx_gated_delta
