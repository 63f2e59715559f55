// The gated RMSNorm's vjp as a primitive (segment_norm.h); its kernel is the
// CPU's (cpu/segment.h).
#include "segment/segment_norm.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/activation_type.h"
#include "core/vmap_fold.h"
#include "cpu/segment.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace mx = mlx::core;

namespace mlx_gated_delta {

namespace {

SegmentParams params_of(const SegmentParams& options, const mx::array& mixed) {
  SegmentParams p = options;
  p.batch = mixed.shape(0);
  p.tokens = mixed.shape(1);
  return p;
}

}  // namespace

std::vector<mx::Shape> GatedDeltaSegmentNormVJP::output_shapes(
    const std::vector<mx::array>& inputs) {
  const SegmentParams p = params_of(options_, inputs[1]);
  return {
      {p.batch, p.tokens, p.value_heads, p.value_dim},
      {p.batch, p.tokens, p.v_width()},
      {p.batch, p.value_dim}};
}

bool GatedDeltaSegmentNormVJP::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatedDeltaSegmentNormVJP&>(other).options_;
  return options_.key_heads == o.key_heads &&
      options_.value_heads == o.value_heads && options_.key_dim == o.key_dim &&
      options_.value_dim == o.value_dim && options_.norm_eps == o.norm_eps &&
      options_.has_mask == o.has_mask;
}

void GatedDeltaSegmentNormVJP::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (auto& output : outputs) {
    output.set_data(mx::allocator::malloc(output.nbytes()));
  }
  const SegmentParams p = params_of(options_, inputs[1]);
  with_activation_type(
      inputs[1].dtype(), "GatedDeltaSegmentNormVJP", [&]<typename T>(T) {
        const cpu::SegmentNormBackwardBuffers<T> io{
            inputs[0].data<float>(),
            inputs[1].data<T>(),
            inputs[2].data<float>(),
            inputs[3].data<T>(),
            p.has_mask ? inputs[4].data<bool>() : nullptr,
            outputs[0].data<float>(),
            outputs[1].data<T>(),
            outputs[2].data<float>()};
        auto& encoder = mx::cpu::get_command_encoder(stream());
        for (const auto& input : inputs) {
          encoder.set_input_array(input);
        }
        for (auto& output : outputs) {
          encoder.set_output_array(output);
        }
        encoder.dispatch(
            [=]() { cpu::gated_delta_segment_norm_backward<T>(p, io); });
      });
}

void GatedDeltaSegmentNormVJP::eval_gpu(
    const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      std::string("mlx_gated_delta: ") + name() +
      " runs on the CPU only (the segment's backward builds it there).");
}

// Every input but the norm weight carries the batch.
std::pair<std::vector<mx::array>, std::vector<int>>
GatedDeltaSegmentNormVJP::vmap(
    const std::vector<mx::array>& inputs, const std::vector<int>& axes) {
  if (axes[2] >= 0) {
    throw std::invalid_argument(
        "mlx_gated_delta.gated_delta_segment: vmap over the layer's weights "
        "is not supported; map over the activations and the states only.");
  }
  const int size = vmap_size(inputs, axes);
  std::vector<mx::array> folded = inputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (i != 2) {
      folded[i] = fold_into_batch(inputs[i], axes[i], size, stream());
    }
  }
  auto outputs = mx::array::make_arrays(
      output_shapes(folded),
      {mx::float32, folded[1].dtype(), mx::float32},
      std::make_shared<GatedDeltaSegmentNormVJP>(stream(), options_),
      folded);
  for (auto& out : outputs) {
    out = unfold_from_batch(out, size, stream());
  }
  return {outputs, std::vector<int>(outputs.size(), 0)};
}

}  // namespace mlx_gated_delta
