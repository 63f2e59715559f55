#include "core/core_op.h"

#include "core/core_params.h"
#include "core/core_primitive.h"
#include "mlx/ops.h"
#include "validation/arguments.h"

#ifdef MLX_GATED_DELTA_CUDA
#include "core/cuda_coverage.h"
#include "cuda/executor.h"
#endif

namespace mx = mlx::core;

namespace mlx_gated_delta {

std::vector<mx::array> gated_delta_rule(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& g,
    const mx::array& beta,
    const std::optional<mx::array>& state,
    std::optional<float> scale,
    const std::string& head_mapping,
    const std::optional<mx::array>& mask,
    bool normalize_qk,
    const std::string& algorithm,
    mx::StreamOrDevice s,
    const CoreArgumentNames& names,
    const std::optional<mx::array>& checkpoints,
    const std::optional<mx::array>& parents,
    const std::optional<mx::array>& gamma) {
  GatedDeltaParams p;
  p.head_mapping = parse_head_mapping(head_mapping);
  Algorithm requested = parse_algorithm(algorithm);
  p.normalize_qk = normalize_qk;
  p.has_mask = mask.has_value();

  check_core_arguments(p, {q, k, v, g, beta, state, mask}, scale, names);
  std::vector<int> positions;
  if (checkpoints) {
    positions = check_checkpoints(*checkpoints, p.tokens);
    p.checkpoint_count = int(positions.size());
  }
  std::vector<int> parent_indices;
  if (parents) {
    parent_indices = check_parents(*parents, p.tokens, requested);
    p.has_tree = true;
  }
  const mx::Shape state_shape = {
      p.batch, p.value_heads, p.value_dim, p.key_dim};

  const mx::Stream stream = mx::to_stream(s);
#ifdef MLX_GATED_DELTA_CUDA
  require_cuda_kernels(
      stream,
      gamma ? "gated_delta_update" : "gated_delta_rule",
      cuda::core_kernels_gap(p));
#endif
  mx::array initial_state =
      state ? *state : mx::zeros(state_shape, mx::float32, stream);
  if (p.tokens == 0) {  // no checkpoint fits in no tokens
    std::vector<mx::array> empty = {
        mx::zeros(v.shape(), v.dtype(), stream), initial_state};
    if (checkpoints) {
      empty.push_back(mx::zeros(
          {0, p.batch, p.value_heads, p.value_dim, p.key_dim},
          mx::float32,
          stream));
    }
    return empty;
  }
  // g and beta are read in float32: widening is exact, and they are never
  // rounded to the activation dtype.
  std::vector<mx::array> inputs = {
      mx::contiguous(q, false, stream),
      mx::contiguous(k, false, stream),
      mx::contiguous(v, false, stream),
      mx::contiguous(mx::astype(g, mx::float32, stream), false, stream),
      mx::contiguous(mx::astype(beta, mx::float32, stream), false, stream),
      mx::contiguous(initial_state, false, stream)};
  if (mask) {
    inputs.push_back(mx::contiguous(*mask, false, stream));
  }
  std::vector<mx::Shape> shapes = {v.shape(), state_shape};
  std::vector<mx::Dtype> dtypes = {v.dtype(), mx::float32};
  if (checkpoints) {
    inputs.push_back(
        mx::array(positions.begin(), {p.checkpoint_count}, mx::int32));
    shapes.push_back(
        {p.checkpoint_count, p.batch, p.value_heads, p.value_dim, p.key_dim});
    dtypes.push_back(mx::float32);
  }
  if (parents) {
    inputs.push_back(mx::array(parent_indices.begin(), {p.tokens}, mx::int32));
  }
  // Last: read by the vjp only.
  if (gamma) {
    inputs.push_back(mx::astype(*gamma, mx::float32, stream));
  }
  return mx::array::make_arrays(
      shapes,
      dtypes,
      std::make_shared<GatedDeltaRule>(
          stream,
          CoreOptions{
              .scale = p.scale,
              .head_mapping = p.head_mapping,
              .normalize_qk = p.normalize_qk,
              .has_mask = p.has_mask,
              // The requested algorithm, Auto included: eval_cpu and the
              // Metal plan resolve Auto per shape, and the vjp passes an
              // explicit choice on to the backward (Auto lets it choose its
              // own form).
              .algorithm = p.has_tree ? Algorithm::Recurrent : requested,
              .has_checkpoints = checkpoints.has_value(),
              .has_tree = p.has_tree,
              .has_gamma = gamma.has_value()}),
      inputs);
}

}  // namespace mlx_gated_delta
