#include "core/core_primitive.h"

#include <stdexcept>

#include "core/activation_type.h"
#include "core/backward_primitive.h"
#include "core/dispatch.h"
#include "core/vmap_fold.h"
#include "cpu/forward.h"
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

enum CoreInput { kQ = 0, kK, kV, kG, kBeta, kState, kMask };

// The checkpoints come after the mask, when there is one, and the parents
// after both.
int checkpoints_input(bool has_mask) {
  return has_mask ? kMask + 1 : kMask;
}
int parents_input(bool has_mask, bool has_checkpoints) {
  return checkpoints_input(has_mask) + (has_checkpoints ? 1 : 0);
}

template <typename T>
void run_cpu(
    const GatedDeltaParams& p,
    Algorithm algorithm,
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& g,
    const mx::array& beta,
    const mx::array& state,
    const mx::array* mask,
    const mx::array* checkpoints,
    mx::array& y,
    mx::array& state_out,
    mx::array* checkpoint_states,
    const mx::array* parents) {
  cpu::gated_delta_forward<T>(
      p,
      algorithm,
      cpu::contiguous_buffers<T>(
          p,
          q.data<T>(),
          k.data<T>(),
          v.data<T>(),
          g.data<float>(),
          beta.data<float>(),
          mask ? mask->data<bool>() : nullptr,
          state.data<float>(),
          y.data<T>(),
          state_out.data<float>(),
          checkpoints ? checkpoints->data<int>() : nullptr,
          checkpoint_states ? checkpoint_states->data<float>() : nullptr,
          parents ? parents->data<int>() : nullptr));
}

}  // namespace

GatedDeltaParams GatedDeltaRule::params_for(
    const std::vector<mx::array>& inputs) const {
  const auto& q = inputs[kQ];
  const auto& v = inputs[kV];
  return options_.params(
      {q.shape(0), q.shape(1), q.shape(2), v.shape(2), q.shape(3), v.shape(3)},
      options_.has_checkpoints
          ? int(inputs[checkpoints_input(options_.has_mask)].size())
          : 0,
      inputs[kG].ndim() == 4);
}

void GatedDeltaRule::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const GatedDeltaParams p = params_for(inputs);
  for (auto& output : outputs) {
    output.set_data(mx::allocator::malloc(output.nbytes()));
  }
  auto& y = outputs[0];
  auto& state_out = outputs[1];

  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& input : inputs) {
    encoder.set_input_array(input);
  }
  for (auto& output : outputs) {
    encoder.set_output_array(output);
  }
  const bool with_checkpoints = p.checkpoint_count > 0;
  const Algorithm algorithm = options_.algorithm == Algorithm::Auto
      ? resolve_cpu_algorithm(p)
      : options_.algorithm;
  encoder.dispatch(
      [p,
       algorithm,
       q = mx::array::unsafe_weak_copy(inputs[kQ]),
       k = mx::array::unsafe_weak_copy(inputs[kK]),
       v = mx::array::unsafe_weak_copy(inputs[kV]),
       g = mx::array::unsafe_weak_copy(inputs[kG]),
       beta = mx::array::unsafe_weak_copy(inputs[kBeta]),
       state = mx::array::unsafe_weak_copy(inputs[kState]),
       mask = p.has_mask
           ? std::optional(mx::array::unsafe_weak_copy(inputs[kMask]))
           : std::nullopt,
       checkpoints = with_checkpoints
           ? std::optional(mx::array::unsafe_weak_copy(
                 inputs[checkpoints_input(p.has_mask)]))
           : std::nullopt,
       y = mx::array::unsafe_weak_copy(y),
       state_out = mx::array::unsafe_weak_copy(state_out),
       checkpoint_states = with_checkpoints
           ? std::optional(mx::array::unsafe_weak_copy(outputs[2]))
           : std::nullopt,
       parents = p.has_tree
           ? std::optional(mx::array::unsafe_weak_copy(
                 inputs[parents_input(p.has_mask, options_.has_checkpoints)]))
           : std::nullopt]() mutable {
        const mx::array* mask_ptr = mask ? &*mask : nullptr;
        const mx::array* checkpoints_ptr =
            checkpoints ? &*checkpoints : nullptr;
        mx::array* checkpoint_states_ptr =
            checkpoint_states ? &*checkpoint_states : nullptr;
        const mx::array* parents_ptr = parents ? &*parents : nullptr;
        with_activation_type(v.dtype(), "GatedDeltaRule", [&]<typename T>(T) {
          run_cpu<T>(
              p,
              algorithm,
              q,
              k,
              v,
              g,
              beta,
              state,
              mask_ptr,
              checkpoints_ptr,
              y,
              state_out,
              checkpoint_states_ptr,
              parents_ptr);
        });
      });
}

void GatedDeltaRule::eval_gpu(
    [[maybe_unused]] const std::vector<mx::array>& inputs,
    [[maybe_unused]] std::vector<mx::array>& outputs) {
#ifdef _METAL_
  // gamma, when present, is the last input and for the vjp only.
  const std::vector<mx::array> kernel_inputs(
      inputs.begin(), inputs.end() - (options_.has_gamma ? 1 : 0));
  metal::eval_core_gpu(
      params_for(inputs), options_.algorithm, kernel_inputs, outputs, stream());
#elif defined(MLX_GATED_DELTA_CUDA)
  // As on Metal: gamma, the vjp's last input, is not the kernels'.
  cuda::eval_core(
      params_for(inputs),
      options_.algorithm,
      {inputs.begin(), inputs.end() - (options_.has_gamma ? 1 : 0)},
      outputs,
      stream());
#else
  throw std::runtime_error(
      "mlx_gated_delta: this build has no GPU kernels (Metal kernels are built "
      "on macOS only); run the op on the CPU (stream=mx.cpu).");
#endif
}

// The backward is a primitive of its own (backward_primitive.h).
std::vector<mx::array> GatedDeltaRule::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  if (options_.has_checkpoints || options_.has_tree) {
    throw std::invalid_argument(
        "mlx_gated_delta.gated_delta_rule: no gradient through a call with "
        "checkpoints or parents (serving calls); differentiate a call without them.");
  }
  return gated_delta_rule_vjp(stream(), options_, primals, cotangents, argnums);
}

std::vector<mx::array> GatedDeltaRule::jvp(
    const std::vector<mx::array>&,
    const std::vector<mx::array>&,
    const std::vector<int>&) {
  throw std::runtime_error(
      "mlx_gated_delta.gated_delta_rule has no jvp yet: forward-mode "
      "differentiation through it is not implemented.");
}

// Every input of the core op carries the batch: each mapped axis folds into
// it (core/vmap_fold.h).
std::pair<std::vector<mx::array>, std::vector<int>> GatedDeltaRule::vmap(
    const std::vector<mx::array>& inputs, const std::vector<int>& axes) {
  const int size = vmap_size(inputs, axes);
  // The checkpoint positions and the parents are the same for every mapped
  // call: they are not folded (and may not be mapped).
  std::vector<bool> unfolded(inputs.size(), false);
  const CoreOptions& o = options_;
  if (o.has_checkpoints)
    unfolded[checkpoints_input(o.has_mask)] = true;
  if (o.has_tree)
    unfolded[parents_input(o.has_mask, o.has_checkpoints)] = true;
  std::vector<mx::array> folded;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!unfolded[i]) {
      folded.push_back(fold_into_batch(inputs[i], axes[i], size, stream()));
    } else if (axes[i] >= 0) {
      throw std::invalid_argument(
          "gated_delta_rule: checkpoints and parents cannot be mapped by vmap "
          "(pass one list)");
    } else {
      folded.push_back(inputs[i]);
    }
  }
  std::vector<mx::Dtype> dtypes = {folded[kV].dtype(), mx::float32};
  if (o.has_checkpoints)
    dtypes.push_back(mx::float32);
  auto outputs = mx::array::make_arrays(
      output_shapes(folded),
      dtypes,
      std::make_shared<GatedDeltaRule>(stream(), options_),
      folded);
  // y and the state lead with the batch; the checkpoint states with the
  // checkpoint, then the batch.
  std::vector<int> out_axes;
  for (size_t n = 0; n < outputs.size(); ++n) {
    const int batch_axis = n == 2 ? 1 : 0;
    mx::Shape shape = outputs[n].shape();
    shape[batch_axis] /= size;
    shape.insert(shape.begin() + batch_axis, size);
    outputs[n] = mx::reshape(outputs[n], shape, stream());
    out_axes.push_back(batch_axis);
  }
  return {outputs, out_axes};
}

bool GatedDeltaRule::is_equivalent(const mx::Primitive& other) const {
  return options_ == static_cast<const GatedDeltaRule&>(other).options_;
}

std::vector<mx::Shape> GatedDeltaRule::output_shapes(
    const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes = {inputs[kV].shape(), inputs[kState].shape()};
  if (options_.has_checkpoints) {
    mx::Shape checkpoint_shape = inputs[kState].shape();
    checkpoint_shape.insert(
        checkpoint_shape.begin(),
        inputs[checkpoints_input(options_.has_mask)].shape(0));
    shapes.push_back(checkpoint_shape);
  }
  return shapes;
}

}  // namespace mlx_gated_delta
