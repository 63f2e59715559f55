#include "core/backward_primitive.h"

#include <optional>
#include <stdexcept>

#include "core/activation_type.h"
#include "core/dispatch.h"
#include "core/vmap_fold.h"
#include "cpu/backward.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

#ifdef _METAL_
#include "metal/executor.h"
#elif defined(MLX_GATED_DELTA_CUDA)
#include "core/cuda_coverage.h"
#include "cuda/executor.h"
#endif

namespace mx = mlx::core;

namespace mlx_gated_delta {

namespace {

enum Input { kQ = 0, kK, kV, kG, kBeta, kState, kMask };
enum Output { kDq = 0, kDk, kDv, kDg, kDgamma, kDbeta, kDstate };

template <typename T>
void run_cpu(
    const GatedDeltaParams& p,
    Algorithm algorithm,
    const std::vector<mx::array>& in,
    std::vector<mx::array>& out) {
  const size_t cotangents = p.has_mask ? kMask + 1 : kMask;
  cpu::BackwardBuffers<T> buffers{
      in[kQ].data<T>(),
      in[kK].data<T>(),
      in[kV].data<T>(),
      in[kG].data<float>(),
      in[kBeta].data<float>(),
      p.has_mask ? in[kMask].data<bool>() : nullptr,
      in[kState].data<float>(),
      in[cotangents].data<T>(),
      in[cotangents + 1].data<float>(),
      out[kDq].data<T>(),
      out[kDk].data<T>(),
      out[kDv].data<T>(),
      out[kDg].data<float>(),
      out[kDgamma].data<float>(),
      out[kDbeta].data<float>(),
      out[kDstate].data<float>()};
  cpu::gated_delta_backward<T>(p, algorithm, buffers);
}

// Gradients in their inputs' dtypes: q, k and v in the activation dtype; the
// gates and the state are float32 inputs of the primitive.
std::vector<mx::Dtype> output_dtypes(const std::vector<mx::array>& inputs) {
  return {
      inputs[kQ].dtype(),
      inputs[kK].dtype(),
      inputs[kV].dtype(),
      mx::float32,
      mx::float32,
      mx::float32,
      mx::float32};
}

std::vector<mx::Shape> gradient_shapes(const std::vector<mx::array>& inputs) {
  return {
      inputs[kQ].shape(),
      inputs[kK].shape(),
      inputs[kV].shape(),
      inputs[kG].shape(),
      inputs[kG].shape(),
      inputs[kBeta].shape(),
      inputs[kState].shape()};
}

GatedDeltaParams backward_params(
    const CoreOptions& options, const std::vector<mx::array>& inputs) {
  const auto& q = inputs[kQ];
  const auto& v = inputs[kV];
  return options.params(
      {q.shape(0), q.shape(1), q.shape(2), v.shape(2), q.shape(3), v.shape(3)},
      0,
      inputs[kG].ndim() == 4);
}

}  // namespace

GatedDeltaParams GatedDeltaRuleVJP::params_for(
    const std::vector<mx::array>& inputs) const {
  return backward_params(options_, inputs);
}

void GatedDeltaRuleVJP::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const GatedDeltaParams p = params_for(inputs);
  const Algorithm algorithm = options_.algorithm == Algorithm::Auto
      ? resolve_cpu_backward_algorithm(p)
      : options_.algorithm;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& input : inputs) {
    encoder.set_input_array(input);
  }
  std::vector<mx::array> out;
  for (auto& output : outputs) {
    output.set_data(mx::allocator::malloc(output.nbytes()));
    encoder.set_output_array(output);
    out.push_back(mx::array::unsafe_weak_copy(output));
  }
  std::vector<mx::array> in;
  for (const auto& input : inputs) {
    in.push_back(mx::array::unsafe_weak_copy(input));
  }
  encoder.dispatch(
      [p, algorithm, in = std::move(in), out = std::move(out)]() mutable {
        with_activation_type(
            in[kV].dtype(), "GatedDeltaRuleVJP", [&]<typename T>(T) {
              run_cpu<T>(p, algorithm, in, out);
            });
      });
}

void GatedDeltaRuleVJP::eval_gpu(
    [[maybe_unused]] const std::vector<mx::array>& inputs,
    [[maybe_unused]] std::vector<mx::array>& outputs) {
#ifdef _METAL_
  metal::eval_backward_gpu(
      params_for(inputs), options_.algorithm, inputs, outputs, stream());
#elif defined(MLX_GATED_DELTA_CUDA)
  cuda::eval_backward(
      params_for(inputs), options_.algorithm, inputs, outputs, stream());
#else
  throw std::runtime_error(
      "mlx_gated_delta: this build has no GPU kernels (Metal kernels are built "
      "on macOS only); take the gradient on the CPU (stream=mx.cpu).");
#endif
}

// Folds the vmapped axis into the batch axis (core/vmap_fold.h), as
// GatedDeltaRule::vmap does: every input and output has the batch as its
// leading axis.
std::pair<std::vector<mx::array>, std::vector<int>> GatedDeltaRuleVJP::vmap(
    const std::vector<mx::array>& inputs, const std::vector<int>& axes) {
  const int size = vmap_size(inputs, axes);
  std::vector<mx::array> folded;
  for (size_t i = 0; i < inputs.size(); ++i) {
    folded.push_back(fold_into_batch(inputs[i], axes[i], size, stream()));
  }
  auto outputs = mx::array::make_arrays(
      output_shapes(folded),
      output_dtypes(folded),
      std::make_shared<GatedDeltaRuleVJP>(stream(), options_),
      folded);
  for (auto& out : outputs) {
    out = unfold_from_batch(out, size, stream());
  }
  return {outputs, std::vector<int>(outputs.size(), 0)};
}

bool GatedDeltaRuleVJP::is_equivalent(const mx::Primitive& other) const {
  return options_ == static_cast<const GatedDeltaRuleVJP&>(other).options_;
}

std::vector<mx::Shape> GatedDeltaRuleVJP::output_shapes(
    const std::vector<mx::array>& inputs) {
  return gradient_shapes(inputs);
}

std::vector<mx::array> gated_delta_rule_vjp(
    mx::Stream stream,
    const CoreOptions& options,
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums) {
  const mx::Dtype activation = primals[kV].dtype();
  const bool has_mask = options.has_mask;
  std::vector<mx::array> inputs(
      primals.begin(), primals.begin() + (has_mask ? kMask + 1 : kMask));
  CoreOptions backward = options;
  backward.has_checkpoints = false;
  backward.has_tree = false;
  backward.has_gamma = false;
#ifdef MLX_GATED_DELTA_CUDA
  require_cuda_kernels(
      stream,
      options.has_gamma ? "the gradient of gated_delta_update"
                        : "the gradient of gated_delta_rule",
      cuda::backward_kernels_gap(backward_params(backward, inputs)));
#endif
  inputs.push_back(mx::contiguous(
      mx::astype(cotangents[0], activation, stream), false, stream));
  inputs.push_back(mx::contiguous(
      mx::astype(cotangents[1], mx::float32, stream), false, stream));
  auto grads = mx::array::make_arrays(
      gradient_shapes(inputs),
      output_dtypes(inputs),
      std::make_shared<GatedDeltaRuleVJP>(stream, backward),
      inputs);
  const int gamma_argnum =
      options.has_gamma ? (has_mask ? kMask + 1 : kMask) : -1;
  std::vector<mx::array> result;
  for (int argnum : argnums) {
    switch (argnum) {
      case kQ:
        result.push_back(grads[kDq]);
        break;
      case kK:
        result.push_back(grads[kDk]);
        break;
      case kV:
        result.push_back(grads[kDv]);
        break;
      case kG:
        result.push_back(grads[kDg]);
        break;
      case kBeta:
        result.push_back(grads[kDbeta]);
        break;
      case kState:
        result.push_back(grads[kDstate]);
        break;
      default:
        if (argnum == gamma_argnum) {
          result.push_back(grads[kDgamma]);
        } else {  // the mask: not differentiable
          result.push_back(mx::zeros_like(primals[argnum], stream));
        }
    }
  }
  return result;
}

}  // namespace mlx_gated_delta
