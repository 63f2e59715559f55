// The primitive of the segment's backward (segment_backward_primitives.h);
// its kernel is the CPU's (cpu/segment.h).
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
#include "cpu/thread_pool.h"
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

// The layer's weights: every other input carries the batch.
const std::vector<int> kWeights = {
    kVJPConvWeight, kVJPDecayParameter, kVJPDtBias, kVJPNormWeight};

}  // namespace

std::vector<mx::Dtype> segment_vjp_dtypes(mx::Dtype activation) {
  std::vector<mx::Dtype> dtypes(kVJPOutputs, mx::float32);
  dtypes[kVJPDMixed] = activation;
  dtypes[kVJPDConvState] = activation;
  return dtypes;
}

std::vector<mx::Shape> GatedDeltaSegmentVJP::output_shapes(
    const std::vector<mx::array>& inputs) {
  const SegmentParams p = params_of(options_, inputs[kVJPMixed]);
  return {
      {p.batch, p.tokens, p.mixed_qkvzba_width()},
      {p.batch, p.conv_channels(), p.conv_kernel},
      {p.batch, p.value_heads},
      {p.batch, p.gate_width()},
      {p.batch, p.value_dim},
      {p.batch, p.conv_state_rows(), p.conv_channels()},
      {p.batch, p.value_heads, p.value_dim, p.key_dim}};
}

bool GatedDeltaSegmentVJP::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatedDeltaSegmentVJP&>(other);
  return same_options(options_, o.options_) && algorithm_ == o.algorithm_;
}

void GatedDeltaSegmentVJP::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  allocate(outputs);
  const SegmentParams p = params_of(options_, inputs[kVJPMixed]);
  const GatedDeltaParams core = p.core_params();
  const Algorithm forward =
      algorithm_ == Algorithm::Auto ? resolve_cpu_algorithm(core) : algorithm_;
  const Algorithm backward = algorithm_ == Algorithm::Auto
      ? resolve_cpu_backward_algorithm(core)
      : algorithm_;
  // The float32 scratch (SegmentBackwardBuffers), held by the encoder until
  // the kernel is done.
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const auto scratch = [&](const mx::Shape& shape) {
    mx::array buffer(shape, mx::float32, nullptr, {});
    buffer.set_data(mx::allocator::malloc(buffer.nbytes()));
    encoder.add_temporary(buffer);
    return buffer.data<float>();
  };
  // One wave's q, k, v, y, gates and states (cpu/segment.h).
  const int wave_key_heads =
      cpu::segment_wave_key_heads(p, cpu::thread_count());
  const int wave_heads = wave_key_heads * (p.value_heads / p.key_heads);
  const mx::Shape qk = {p.batch, p.tokens, wave_key_heads, p.key_dim};
  const mx::Shape v = {p.batch, p.tokens, wave_heads, p.value_dim};
  const mx::Shape per_head = {p.batch, p.tokens, wave_heads};
  const mx::Shape gates = p.per_key_gates
      ? mx::Shape{p.batch, p.tokens, wave_heads, p.key_dim}
      : per_head;
  const mx::Shape state = {p.batch, wave_heads, p.value_dim, p.key_dim};
  float* y = scratch(v);
  float* g = scratch(gates);
  float* dg = scratch(gates);
  float* dgamma = scratch(gates);
  float* beta = scratch(per_head);
  float* dbeta = scratch(per_head);
  float* wave_state_in = scratch(state);
  float* state_out = scratch(state);
  float* wave_d_state_out = scratch(state);
  float* wave_dstate = scratch(state);
  float* dq = scratch(qk);
  float* dk = scratch(qk);
  float* dv = scratch(v);
  with_activation_type(
      inputs[kVJPMixed].dtype(), "GatedDeltaSegmentVJP", [&]<typename T>(T) {
        const cpu::SegmentBackwardBuffers<T> io{
            inputs[kVJPMixed].data<T>(),
            inputs[kVJPConvWeight].data<float>(),
            inputs[kVJPDecayParameter].data<float>(),
            inputs[kVJPDtBias].data<float>(),
            inputs[kVJPNormWeight].data<float>(),
            inputs[kVJPConvState].data<T>(),
            inputs[kVJPState].data<float>(),
            p.has_mask ? inputs[kVJPInputs].data<bool>() : nullptr,
            inputs[kVJPOutCotangent].data<T>(),
            inputs[kVJPConvStateCotangent].data<T>(),
            inputs[kVJPStateCotangent].data<float>(),
            wave_key_heads,
            y,
            g,
            dg,
            dgamma,
            beta,
            dbeta,
            wave_state_in,
            state_out,
            wave_d_state_out,
            wave_dstate,
            dq,
            dk,
            dv,
            outputs[kVJPDMixed].data<T>(),
            outputs[kVJPDConvState].data<T>(),
            outputs[kVJPDConvWeightRows].data<float>(),
            outputs[kVJPDDecayParameterRows].data<float>(),
            outputs[kVJPDDtBiasRows].data<float>(),
            outputs[kVJPDNormWeightRows].data<float>(),
            outputs[kVJPDState].data<float>()};
        dispatch(stream(), inputs, outputs, [=]() {
          cpu::gated_delta_segment_backward<T>(p, forward, backward, io);
        });
      });
}

void GatedDeltaSegmentVJP::eval_gpu(
    const std::vector<mx::array>&, std::vector<mx::array>&) {
  cpu_only(name());
}

std::pair<std::vector<mx::array>, std::vector<int>> GatedDeltaSegmentVJP::vmap(
    const std::vector<mx::array>& inputs, const std::vector<int>& axes) {
  return vmap_by_folding(
      std::make_shared<GatedDeltaSegmentVJP>(stream(), options_, algorithm_),
      inputs,
      axes,
      kWeights,
      segment_vjp_dtypes(inputs[kVJPMixed].dtype()));
}

}  // namespace mlx_gated_delta
