// The primitives of the segment's backward (segment_backward_primitives.h);
// their kernels are the CPU's (cpu/segment.h).
#include "segment/segment_backward_primitives.h"

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/activation_type.h"
#include "core/dispatch.h"
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

// Whether two primitives built from these options compute the same thing
// (the batch and the tokens come from the inputs).
bool same_options(const SegmentParams& a, const SegmentParams& b) {
  return a.key_heads == b.key_heads && a.value_heads == b.value_heads &&
      a.key_dim == b.key_dim && a.value_dim == b.value_dim &&
      a.conv_kernel == b.conv_kernel &&
      a.decay_parameterization == b.decay_parameterization &&
      a.norm_eps == b.norm_eps && a.has_mask == b.has_mask &&
      a.per_key_gates == b.per_key_gates && a.gates == b.gates;
}

void allocate(std::vector<mx::array>& outputs) {
  for (auto& output : outputs) {
    output.set_data(mx::allocator::malloc(output.nbytes()));
  }
}

template <typename Task>
void dispatch(
    mx::Stream stream,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    Task&& task) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& input : inputs) {
    encoder.set_input_array(input);
  }
  for (auto& output : outputs) {
    encoder.set_output_array(output);
  }
  encoder.dispatch(std::forward<Task>(task));
}

[[noreturn]] void cpu_only(const char* name) {
  throw std::runtime_error(
      std::string("mlx_gated_delta: ") + name +
      " runs on the CPU only (the segment's backward builds it there).");
}

// vmap by folding the mapped axis into the batch: every input but the
// layer's weights (`weights`, which may not be mapped) carries the batch.
// Calls `primitive` once on the folded inputs and unfolds its outputs.
std::pair<std::vector<mx::array>, std::vector<int>> vmap_by_folding(
    const std::shared_ptr<mx::Primitive>& primitive,
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes,
    const std::vector<int>& weights,
    const std::vector<mx::Dtype>& dtypes) {
  const auto is_weight = [&](int i) {
    return std::find(weights.begin(), weights.end(), i) != weights.end();
  };
  for (int i : weights) {
    if (axes[i] >= 0) {
      throw std::invalid_argument(
          "mlx_gated_delta.gated_delta_segment: vmap over the layer's weights "
          "is not supported; map over the activations and the states only.");
    }
  }
  const mx::Stream s = primitive->stream();
  const int size = vmap_size(inputs, axes);
  std::vector<mx::array> folded = inputs;
  for (int i = 0; i < int(inputs.size()); ++i) {
    if (!is_weight(i)) {
      folded[i] = fold_into_batch(inputs[i], axes[i], size, s);
    }
  }
  auto outputs = mx::array::make_arrays(
      primitive->output_shapes(folded), dtypes, primitive, folded);
  for (auto& out : outputs) {
    out = unfold_from_batch(out, size, s);
  }
  return {outputs, std::vector<int>(outputs.size(), 0)};
}

const std::vector<int> kPrepareWeights = {
    kPrepareConvWeight, kPrepareDecayParameter, kPrepareDtBias};

// g's shape, and dg's: [B, T, Hv], or [B, T, Hv, Dk] with per-key gates.
mx::Shape gate_shape(const SegmentParams& p) {
  return p.per_key_gates
      ? mx::Shape{p.batch, p.tokens, p.value_heads, p.key_dim}
      : mx::Shape{p.batch, p.tokens, p.value_heads};
}

}  // namespace

std::vector<mx::Dtype> segment_core_vjp_dtypes(mx::Dtype activation) {
  std::vector<mx::Dtype> dtypes(8, mx::float32);
  dtypes[6] = activation;  // dz
  return dtypes;
}

std::vector<mx::Shape> GatedDeltaSegmentCoreVJP::output_shapes(
    const std::vector<mx::array>& inputs) {
  const SegmentParams p = params_of(options_, inputs[kPrepareMixed]);
  return {
      {p.batch, p.tokens, p.key_heads, p.key_dim},
      {p.batch, p.tokens, p.key_heads, p.key_dim},
      {p.batch, p.tokens, p.value_heads, p.value_dim},
      gate_shape(p),
      {p.batch, p.tokens, p.value_heads},
      {p.batch, p.value_heads, p.value_dim, p.key_dim},
      {p.batch, p.tokens, p.v_width()},
      {p.batch, p.value_dim}};
}

bool GatedDeltaSegmentCoreVJP::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatedDeltaSegmentCoreVJP&>(other);
  return same_options(options_, o.options_) && algorithm_ == o.algorithm_;
}

void GatedDeltaSegmentCoreVJP::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  allocate(outputs);
  const SegmentParams p = params_of(options_, inputs[kPrepareMixed]);
  const GatedDeltaParams core = p.core_params();
  const Algorithm forward =
      algorithm_ == Algorithm::Auto ? resolve_cpu_algorithm(core) : algorithm_;
  const Algorithm backward = algorithm_ == Algorithm::Auto
      ? resolve_cpu_backward_algorithm(core)
      : algorithm_;
  // The float32 scratch, held by the encoder until the kernel is done: y
  // (then dy), g, beta, dgamma and the final state.
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const auto scratch = [&](const mx::Shape& shape) {
    mx::array buffer(shape, mx::float32, nullptr, {});
    buffer.set_data(mx::allocator::malloc(buffer.nbytes()));
    encoder.add_temporary(buffer);
    return buffer.data<float>();
  };
  float* y = scratch({p.batch, p.tokens, p.value_heads, p.value_dim});
  float* g = scratch(gate_shape(p));
  float* beta = scratch({p.batch, p.tokens, p.value_heads});
  float* dgamma = scratch(gate_shape(p));
  float* state_out = scratch({p.batch, p.value_heads, p.value_dim, p.key_dim});
  with_activation_type(
      inputs[kPrepareMixed].dtype(),
      "GatedDeltaSegmentCoreVJP",
      [&]<typename T>(T) {
        const cpu::SegmentCoreBackwardBuffers<T> io{
            inputs[kPrepareMixed].data<T>(),
            inputs[kPrepareConvWeight].data<float>(),
            inputs[kPrepareDecayParameter].data<float>(),
            inputs[kPrepareDtBias].data<float>(),
            inputs[kCoreVJPNormWeight].data<float>(),
            inputs[kPrepareConvState].data<T>(),
            inputs[kCoreVJPState].data<float>(),
            p.has_mask ? inputs[kCoreVJPInputs].data<bool>() : nullptr,
            inputs[kCoreVJPOutCotangent].data<T>(),
            inputs[kCoreVJPStateCotangent].data<float>(),
            y,
            g,
            beta,
            dgamma,
            state_out,
            outputs[0].data<float>(),
            outputs[1].data<float>(),
            outputs[2].data<float>(),
            outputs[3].data<float>(),
            outputs[4].data<float>(),
            outputs[5].data<float>(),
            outputs[6].data<T>(),
            outputs[7].data<float>()};
        dispatch(stream(), inputs, outputs, [=]() {
          cpu::gated_delta_segment_core_backward<T>(p, forward, backward, io);
        });
      });
}

void GatedDeltaSegmentCoreVJP::eval_gpu(
    const std::vector<mx::array>&, std::vector<mx::array>&) {
  cpu_only(name());
}

// Every input but the layer's weights carries the batch.
std::pair<std::vector<mx::array>, std::vector<int>>
GatedDeltaSegmentCoreVJP::vmap(
    const std::vector<mx::array>& inputs, const std::vector<int>& axes) {
  std::vector<int> weights = kPrepareWeights;
  weights.push_back(kCoreVJPNormWeight);
  return vmap_by_folding(
      std::make_shared<GatedDeltaSegmentCoreVJP>(
          stream(), options_, algorithm_),
      inputs,
      axes,
      weights,
      segment_core_vjp_dtypes(inputs[kPrepareMixed].dtype()));
}

std::vector<mx::Shape> GatedDeltaSegmentPrepareVJP::output_shapes(
    const std::vector<mx::array>& inputs) {
  const SegmentParams p = params_of(options_, inputs[kPrepareMixed]);
  return {
      {p.batch, p.tokens, p.mixed_qkvzba_width()},
      {p.batch, p.conv_channels(), p.conv_kernel},
      {p.batch, p.value_heads},
      {p.batch, p.gate_width()},
      {p.batch, p.conv_state_rows(), p.conv_channels()}};
}

bool GatedDeltaSegmentPrepareVJP::is_equivalent(
    const mx::Primitive& other) const {
  return same_options(
      options_,
      static_cast<const GatedDeltaSegmentPrepareVJP&>(other).options_);
}

void GatedDeltaSegmentPrepareVJP::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  allocate(outputs);
  const SegmentParams p = params_of(options_, inputs[kPrepareMixed]);
  with_activation_type(
      inputs[kPrepareMixed].dtype(),
      "GatedDeltaSegmentPrepareVJP",
      [&]<typename T>(T) {
        const int d = kPrepareInputs;
        const T* mixed = inputs[kPrepareMixed].data<T>();
        const float* weight = inputs[kPrepareConvWeight].data<float>();
        const float* decay = inputs[kPrepareDecayParameter].data<float>();
        const float* dt_bias = inputs[kPrepareDtBias].data<float>();
        const T* conv_state = inputs[kPrepareConvState].data<T>();
        const T* d_conv_state_out = inputs[d + 6].data<T>();
        const bool* mask = p.has_mask
            ? inputs[d + kPrepareCotangentCount].data<bool>()
            : nullptr;
        const cpu::SegmentPrepareBackwardBuffers<T> io{
            mixed,
            weight,
            decay,
            dt_bias,
            conv_state,
            mask,
            inputs[d].data<float>(),
            inputs[d + 1].data<float>(),
            inputs[d + 2].data<float>(),
            inputs[d + 3].data<float>(),
            inputs[d + 4].data<float>(),
            inputs[d + 5].data<T>(),
            d_conv_state_out,
            outputs[0].data<T>(),
            outputs[4].data<T>(),
            outputs[1].data<float>(),
            outputs[2].data<float>(),
            outputs[3].data<float>()};
        dispatch(stream(), inputs, outputs, [=]() {
          cpu::gated_delta_segment_prepare_backward<T>(p, io);
        });
      });
}

void GatedDeltaSegmentPrepareVJP::eval_gpu(
    const std::vector<mx::array>&, std::vector<mx::array>&) {
  cpu_only(name());
}

std::pair<std::vector<mx::array>, std::vector<int>>
GatedDeltaSegmentPrepareVJP::vmap(
    const std::vector<mx::array>& inputs, const std::vector<int>& axes) {
  const mx::Dtype dtype = inputs[kPrepareMixed].dtype();
  return vmap_by_folding(
      std::make_shared<GatedDeltaSegmentPrepareVJP>(stream(), options_),
      inputs,
      axes,
      kPrepareWeights,
      {dtype, mx::float32, mx::float32, mx::float32, dtype});
}

}  // namespace mlx_gated_delta
