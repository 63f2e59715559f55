#include "ops.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "gated_delta/params.h"
#include "mlx/ops.h"
#include "primitives.h"
#include "validation.h"

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
    const std::optional<mx::array>& linear_gate) {
  GatedDeltaParams p;
  p.head_mapping = parse_head_mapping(head_mapping);
  Algorithm requested = parse_algorithm(algorithm);
  p.normalize_qk = normalize_qk;
  p.has_mask = mask.has_value();

  check_rank("q", q, 4, "[B, T, Hk, Dk]");
  check_rank("k", k, 4, "[B, T, Hk, Dk]");
  check_rank("v", v, 4, "[B, T, Hv, Dv]");
  p.batch = q.shape(0);
  p.tokens = q.shape(1);
  p.key_heads = q.shape(2);
  p.key_dim = q.shape(3);
  p.value_heads = v.shape(2);
  p.value_dim = v.shape(3);
  check_shape("k", k, q.shape(), "[B, T, Hk, Dk] (the shape of q)");
  check_shape("v", v, {p.batch, p.tokens, p.value_heads, p.value_dim},
              "[B, T, Hv, Dv] (B and T of q)");
  if (p.key_heads == 0 || p.value_heads % p.key_heads != 0) {
    std::ostringstream out;
    out << "value heads (v.shape[2] = " << p.value_heads
        << ") must be a multiple of key heads (q.shape[2] = " << p.key_heads
        << ")";
    throw std::invalid_argument(out.str());
  }
  check_shape(names.g, g, {p.batch, p.tokens, p.value_heads}, "[B, T, Hv]");
  check_shape("beta", beta, {p.batch, p.tokens, p.value_heads}, "[B, T, Hv]");
  const mx::Shape state_shape = {p.batch, p.value_heads, p.value_dim, p.key_dim};
  if (state) {
    check_shape(names.state, *state, state_shape, "[B, Hv, Dv, Dk]");
    if (state->dtype() != mx::float32) {
      throw std::domain_error(
          names.state +
          " must be float32 (the recurrent state is kept in float32), got " +
          dtype_string(state->dtype()));
    }
  }
  if (mask) {
    check_shape("mask", *mask, {p.batch, p.tokens}, "[B, T]");
    if (mask->dtype() != mx::bool_) {
      throw std::domain_error(
          "mask must be a bool array, got " + dtype_string(mask->dtype()));
    }
  }
  check_activation_dtype("q", q);
  check_activation_dtype("k", k);
  check_activation_dtype("v", v);
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype()) {
    throw std::domain_error(
        "q, k and v must share one dtype, got q " + dtype_string(q.dtype()) +
        ", k " + dtype_string(k.dtype()) + ", v " + dtype_string(v.dtype()));
  }
  check_floating(names.g, g);
  check_floating("beta", beta);
  p.scale = scale.value_or(1.0f / std::sqrt(static_cast<float>(p.key_dim)));
  if (!std::isfinite(p.scale)) {
    throw std::invalid_argument("scale must be finite, got " + std::to_string(p.scale));
  }
  // Before any allocation: the same limits on every backend (API.md section 5).
  validate_launch_extents(p);

  auto stream = mx::to_stream(s);
  mx::array initial_state =
      state ? *state : mx::zeros(state_shape, mx::float32, stream);
  if (p.tokens == 0) {
    return {mx::zeros(v.shape(), v.dtype(), stream), initial_state};
  }
  const Algorithm resolved = (requested == Algorithm::Auto &&
                              stream.device == mx::Device::cpu)
      ? resolve_cpu_algorithm(p)
      : requested;

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
  if (linear_gate) {
    inputs.push_back(mx::astype(*linear_gate, mx::float32, stream));
  }
  return mx::array::make_arrays(
      {v.shape(), state_shape},
      {v.dtype(), mx::float32},
      std::make_shared<GatedDeltaRule>(
          stream, p.scale, p.head_mapping, p.normalize_qk, p.has_mask, resolved,
          linear_gate.has_value()),
      inputs);
}

}  // namespace mlx_gated_delta
