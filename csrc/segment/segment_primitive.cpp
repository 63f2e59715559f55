#include "segment/segment_primitive.h"

#include <stdexcept>

#include "core/activation_type.h"
#include "core/vmap_fold.h"
#include "cpu/segment.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

#ifdef _METAL_
#include "metal/executor.h"
#elif defined(MLX_GATED_DELTA_CUDA)
#include "cuda/executor.h"
#endif

namespace mx = mlx::core;

namespace mlx_gated_delta {

namespace {

// The checkpoints come after the mask, when there is one.
int checkpoints_input(bool has_mask) {
  return has_mask ? kMask + 1 : kMask;
}

}  // namespace

SegmentParams GatedDeltaSegment::params_for(
    const std::vector<mx::array>& inputs) const {
  const mx::array& mixed = inputs[kMixedQkvzba];
  const mx::array& conv_weight = inputs[kConvWeight];
  SegmentParams p;
  p.set_shape(
      {mixed.shape(0),
       mixed.shape(1),
       key_heads_,
       value_heads_,
       key_dim_,
       value_dim_});
  p.conv_kernel = conv_weight.shape(1);
  p.decay_parameterization = decay_parameterization_;
  p.head_mapping = head_mapping_;
  p.norm_eps = norm_eps_;
  p.has_mask = has_mask_;
  p.per_key_gates = inputs[kDtBias].ndim() == 2;
  p.gates = gates_;
  p.checkpoint_count =
      has_checkpoints_ ? inputs[checkpoints_input(has_mask_)].size() : 0;
  return p;
}

std::vector<mx::Shape> GatedDeltaSegment::output_shapes(
    const std::vector<mx::array>& inputs) {
  const SegmentParams p = params_for(inputs);
  std::vector<mx::Shape> shapes = {
      {p.batch, p.tokens, p.value_heads, p.value_dim},
      {p.batch, p.conv_state_rows(), p.conv_channels()},
      {p.batch, p.value_heads, p.value_dim, p.key_dim}};
  if (has_checkpoints_) {
    shapes.push_back(
        {p.checkpoint_count, p.batch, p.conv_state_rows(), p.conv_channels()});
    shapes.push_back(
        {p.checkpoint_count, p.batch, p.value_heads, p.value_dim, p.key_dim});
  }
  return shapes;
}

bool GatedDeltaSegment::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatedDeltaSegment&>(other);
  return key_heads_ == o.key_heads_ && value_heads_ == o.value_heads_ &&
      key_dim_ == o.key_dim_ && value_dim_ == o.value_dim_ &&
      decay_parameterization_ == o.decay_parameterization_ &&
      head_mapping_ == o.head_mapping_ && norm_eps_ == o.norm_eps_ &&
      has_mask_ == o.has_mask_ && algorithm_ == o.algorithm_ &&
      has_checkpoints_ == o.has_checkpoints_ && gates_ == o.gates_;
}

namespace {

template <typename T>
void dispatch_segment(
    mx::Stream stream,
    const SegmentParams& p,
    Algorithm algorithm,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  cpu::SegmentBuffers<T> io;
  io.mixed_qkvzba = inputs[kMixedQkvzba].data<T>();
  io.conv_weight = inputs[kConvWeight].data<float>();
  io.decay_parameter = inputs[kDecayParameter].data<float>();
  io.dt_bias = inputs[kDtBias].data<float>();
  io.norm_weight = inputs[kNormWeight].data<float>();
  io.conv_state_in = inputs[kConvState].data<T>();
  io.state_in = inputs[kState].data<float>();
  io.mask = p.has_mask ? inputs[kMask].data<bool>() : nullptr;
  io.out = outputs[0].data<T>();
  io.conv_state_out = outputs[1].data<T>();
  io.state_out = outputs[2].data<float>();
  if (p.checkpoint_count > 0) {
    io.checkpoints = inputs[checkpoints_input(p.has_mask)].data<int>();
    io.conv_checkpoint_states = outputs[3].data<T>();
    io.checkpoint_states = outputs[4].data<float>();
  }

  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& input : inputs) {
    encoder.set_input_array(input);
  }
  for (auto& output : outputs) {
    encoder.set_output_array(output);
  }
  encoder.dispatch([p, algorithm, io]() {
    cpu::gated_delta_segment_forward<T>(p, algorithm, io);
  });
}

}  // namespace

void GatedDeltaSegment::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (auto& output : outputs) {
    output.set_data(mx::allocator::malloc(output.nbytes()));
  }
  const SegmentParams p = params_for(inputs);
  with_activation_type(
      inputs[kMixedQkvzba].dtype(), "GatedDeltaSegment", [&]<typename T>(T) {
        dispatch_segment<T>(stream(), p, algorithm_, inputs, outputs);
      });
}

void GatedDeltaSegment::eval_gpu(
    [[maybe_unused]] const std::vector<mx::array>& inputs,
    [[maybe_unused]] std::vector<mx::array>& outputs) {
#ifdef _METAL_
  metal::eval_segment_gpu(
      params_for(inputs), algorithm_, inputs, outputs, stream());
#elif defined(MLX_GATED_DELTA_CUDA)
  cuda::eval_segment(params_for(inputs), algorithm_, inputs, outputs, stream());
#else
  throw std::runtime_error(
      "mlx_gated_delta: this build has no GPU kernels (Metal kernels are built "
      "on macOS only); run gated_delta_segment on the CPU (stream=mx.cpu).");
#endif
}

std::vector<mx::array> GatedDeltaSegment::jvp(
    const std::vector<mx::array>&,
    const std::vector<mx::array>&,
    const std::vector<int>&) {
  throw std::runtime_error(
      "mlx_gated_delta.gated_delta_segment has no jvp yet: forward-mode "
      "differentiation through it is not implemented.");
}

// The activations, the conv state, the state and the mask carry the batch
// and fold a mapped axis into it (core/vmap_fold.h); the weights (conv
// weight, decay parameter, dt_bias, norm weight) have no batch axis, so
// mapping over them is refused.
std::pair<std::vector<mx::array>, std::vector<int>> GatedDeltaSegment::vmap(
    const std::vector<mx::array>& inputs, const std::vector<int>& axes) {
  for (int i : {kConvWeight, kDecayParameter, kDtBias, kNormWeight}) {
    if (axes[i] >= 0) {
      throw std::invalid_argument(
          "mlx_gated_delta.gated_delta_segment: vmap over the layer's weights "
          "(conv_weight, decay_parameter, dt_bias, norm_weight) is not "
          "supported; map over the activations and the states only.");
    }
  }
  if (has_checkpoints_) {
    throw std::invalid_argument(
        "mlx_gated_delta.gated_delta_segment: vmap of a call with checkpoints is "
        "not supported; call it once per mapped slice.");
  }
  const int size = vmap_size(inputs, axes);
  std::vector<mx::array> folded = inputs;
  for (int i : {kMixedQkvzba, kConvState, kState, kMask}) {
    if (i != kMask || has_mask_) {
      folded[i] = fold_into_batch(inputs[i], axes[i], size, stream());
    }
  }
  auto outputs = mx::array::make_arrays(
      output_shapes(folded),
      {folded[kMixedQkvzba].dtype(), folded[kMixedQkvzba].dtype(), mx::float32},
      std::make_shared<GatedDeltaSegment>(
          stream(),
          key_heads_,
          value_heads_,
          key_dim_,
          value_dim_,
          decay_parameterization_,
          head_mapping_,
          norm_eps_,
          has_mask_,
          algorithm_,
          /*has_checkpoints=*/false,
          gates_),
      folded);
  for (auto& out : outputs) {
    out = unfold_from_batch(out, size, stream());
  }
  return {outputs, {0, 0, 0}};
}

}  // namespace mlx_gated_delta
