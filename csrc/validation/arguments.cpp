#include "validation/arguments.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "mlx/utils.h"
#include "validation/extents.h"

namespace mx = mlx::core;

namespace mlx_gated_delta {

std::string shape_string(const mx::Shape& shape) {
  std::ostringstream out;
  out << '(';
  for (size_t i = 0; i < shape.size(); ++i) {
    out << (i ? ", " : "") << shape[i];
  }
  out << (shape.size() == 1 ? ",)" : ")");
  return out.str();
}

std::string dtype_string(mx::Dtype dtype) {
  std::ostringstream out;
  out << dtype;
  return out.str();
}

void check_rank(
    const std::string& name, const mx::array& a, int rank, const char* layout) {
  if (static_cast<int>(a.ndim()) != rank) {
    std::ostringstream out;
    out << name << " must have rank " << rank << " " << layout << ", got shape "
        << shape_string(a.shape()) << " (rank " << a.ndim() << ")";
    throw std::invalid_argument(out.str());
  }
}

void check_shape(
    const std::string& name,
    const mx::array& a,
    const mx::Shape& expected,
    const char* layout) {
  if (a.shape() != expected) {
    std::ostringstream out;
    out << name << " must have shape " << shape_string(expected) << " "
        << layout << ", got " << shape_string(a.shape());
    throw std::invalid_argument(out.str());
  }
}

void check_floating(const std::string& name, const mx::array& a) {
  if (!mx::issubdtype(a.dtype(), mx::floating)) {
    throw std::domain_error(
        name + " must be a floating-point array, got " +
        dtype_string(a.dtype()));
  }
}

bool is_activation_dtype(mx::Dtype dtype) {
  return dtype == mx::float32 || dtype == mx::float16 || dtype == mx::bfloat16;
}

void check_activation_dtype(const std::string& name, const mx::array& a) {
  if (!is_activation_dtype(a.dtype())) {
    throw std::domain_error(
        name + " must be float32, float16 or bfloat16, got " +
        dtype_string(a.dtype()));
  }
}

void check_state(
    const std::string& name, const mx::array& state, const mx::Shape& shape) {
  check_shape(name, state, shape, "[B, Hv, Dv, Dk]");
  if (state.dtype() != mx::float32) {
    throw std::domain_error(
        name +
        " must be float32 (the recurrent state is kept in float32), got " +
        dtype_string(state.dtype()));
  }
}

void check_mask(const mx::array& mask, int batch, int tokens) {
  check_shape("mask", mask, {batch, tokens}, "[B, T]");
  if (mask.dtype() != mx::bool_) {
    throw std::domain_error(
        "mask must be a bool array, got " + dtype_string(mask.dtype()));
  }
}

void check_core_arguments(
    GatedDeltaParams& p,
    const CoreArrays& arrays,
    std::optional<float> scale,
    const CoreArgumentNames& names) {
  const auto& [q, k, v, g, beta, state, mask] = arrays;
  check_rank("q", q, 4, "[B, T, Hk, Dk]");
  check_rank("k", k, 4, "[B, T, Hk, Dk]");
  check_rank("v", v, 4, "[B, T, Hv, Dv]");
  p.set_shape(
      {q.shape(0), q.shape(1), q.shape(2), v.shape(2), q.shape(3), v.shape(3)});
  check_shape("k", k, q.shape(), "[B, T, Hk, Dk] (the shape of q)");
  check_shape(
      "v",
      v,
      {p.batch, p.tokens, p.value_heads, p.value_dim},
      "[B, T, Hv, Dv] (B and T of q)");
  // Zero-size B, T, Hv or Dv leave nothing to compute (empty results); a
  // key head and a key dim are needed to define the heads' mapping and the
  // default scale Dk ** -0.5.
  if (p.key_heads == 0 || p.key_dim == 0) {
    throw std::invalid_argument(
        std::string(
            "q must have at least one key head and a key dim of at least 1 "
            "[B, T, Hk, Dk] (Hk >= 1, Dk >= 1), got shape ") +
        shape_string(q.shape()));
  }
  if (p.value_heads % p.key_heads != 0) {
    std::ostringstream out;
    out << "value heads (v.shape[2] = " << p.value_heads
        << ") must be a multiple of key heads (q.shape[2] = " << p.key_heads
        << ")";
    throw std::invalid_argument(out.str());
  }
  // g holds one decay per value head, or one per key channel of each value
  // head (per-key gates, docs/contract.md).
  if (g.ndim() == 4) {
    check_shape(
        names.g,
        g,
        {p.batch, p.tokens, p.value_heads, p.key_dim},
        "[B, T, Hv] or [B, T, Hv, Dk] (per-key-channel gates)");
    p.per_key_gates = true;
  } else {
    check_shape(
        names.g,
        g,
        {p.batch, p.tokens, p.value_heads},
        "[B, T, Hv] or [B, T, Hv, Dk] (per-key-channel gates)");
  }
  check_shape("beta", beta, {p.batch, p.tokens, p.value_heads}, "[B, T, Hv]");
  if (state) {
    check_state(
        names.state, *state, {p.batch, p.value_heads, p.value_dim, p.key_dim});
  }
  if (mask) {
    check_mask(*mask, p.batch, p.tokens);
  }
  check_activation_dtype("q", q);
  check_activation_dtype("k", k);
  check_activation_dtype("v", v);
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype()) {
    // The message opens with the one whose dtype differs from the other two.
    const char* odd = k.dtype() == q.dtype() ? "v"
        : v.dtype() == q.dtype()             ? "k"
                                             : "q";
    throw std::domain_error(
        std::string(odd) +
        " must have the dtype of the others: q, k and v share one " +
        "dtype, got q " + dtype_string(q.dtype()) + ", k " +
        dtype_string(k.dtype()) + ", v " + dtype_string(v.dtype()));
  }
  check_floating(names.g, g);
  check_floating("beta", beta);
  p.scale = scale.value_or(default_scale(p.key_dim));
  if (!std::isfinite(p.scale)) {
    throw std::invalid_argument(
        "scale must be finite, got " + std::to_string(p.scale));
  }
  validate_launch_extents(p);
}

std::vector<int> check_checkpoints(const mx::array& checkpoints, int tokens) {
  if (checkpoints.ndim() != 1) {
    throw std::invalid_argument(
        "checkpoints must be a 1-D list of token counts, got shape " +
        shape_string(checkpoints.shape()));
  }
  if (!mx::issubdtype(checkpoints.dtype(), mx::integer)) {
    throw std::domain_error(
        "checkpoints must be integers (token counts), got " +
        dtype_string(checkpoints.dtype()));
  }
  mx::array values = mx::astype(checkpoints, mx::int64, mx::Device::cpu);
  mx::eval(values);
  const int64_t* data = values.data<int64_t>();
  std::vector<int> positions;
  for (size_t n = 0; n < values.size(); ++n) {
    const int64_t position = data[n];
    if (position < 1 || position > tokens) {
      throw std::invalid_argument(
          "checkpoints must lie in [1, T] with T = " + std::to_string(tokens) +
          " tokens, got " + std::to_string(position) + " at index " +
          std::to_string(n));
    }
    if (n > 0 && position <= positions.back()) {
      throw std::invalid_argument(
          "checkpoints must be strictly increasing, got " +
          std::to_string(position) + " after " +
          std::to_string(positions.back()) + " at index " + std::to_string(n));
    }
    positions.push_back(int(position));
  }
  return positions;
}

std::vector<int> check_parents(
    const mx::array& parents, int tokens, Algorithm algorithm) {
  if (parents.ndim() != 1 || parents.shape(0) != tokens) {
    throw std::invalid_argument(
        "parents must be a 1-D list of one parent index per token, shape (" +
        std::to_string(tokens) + ",), got shape " +
        shape_string(parents.shape()));
  }
  if (!mx::issubdtype(parents.dtype(), mx::integer)) {
    throw std::domain_error(
        "parents must be integers (token indices), got " +
        dtype_string(parents.dtype()));
  }
  if (algorithm == Algorithm::Chunked) {
    throw std::invalid_argument(
        "parents (tree verification) runs the recurrent form: algorithm must be "
        "'recurrent' or 'auto', got 'chunked'");
  }
  mx::array values = mx::astype(parents, mx::int64, mx::Device::cpu);
  mx::eval(values);
  const int64_t* data = values.data<int64_t>();
  std::vector<int> result;
  for (int t = 0; t < tokens; ++t) {
    if (data[t] < -1 || data[t] >= t) {
      throw std::invalid_argument(
          "parents must name an earlier token or -1 (the initial state): parents[" +
          std::to_string(t) + "] must lie in [-1, " + std::to_string(t - 1) +
          "], got " + std::to_string(data[t]));
    }
    result.push_back(int(data[t]));
  }
  return result;
}

namespace {

void check_positive(const char* name, int value) {
  if (value <= 0) {
    throw std::invalid_argument(
        std::string(name) + " must be positive, got " + std::to_string(value));
  }
}

}  // namespace

void check_segment_arguments(
    SegmentParams& p,
    const SegmentArrays& arrays,
    const ProblemShape& heads,
    float norm_eps) {
  const auto& [mixed_qkvzba, conv_weight, decay_parameter, dt_bias, norm_weight, conv_state, state, mask] =
      arrays;
  const int key_heads = heads.key_heads, value_heads = heads.value_heads;
  const int key_dim = heads.key_dim, value_dim = heads.value_dim;
  check_positive("key_heads", key_heads);
  check_positive("value_heads", value_heads);
  check_positive("key_dim", key_dim);
  check_positive("value_dim", value_dim);
  if (value_heads % key_heads != 0) {
    throw std::invalid_argument(
        "value_heads (" + std::to_string(value_heads) +
        ") must be a multiple of key_heads (" + std::to_string(key_heads) +
        ")");
  }
  if (!std::isfinite(norm_eps) || norm_eps < 0.0f) {
    throw std::invalid_argument(
        "norm_eps must be finite and >= 0, got " + std::to_string(norm_eps));
  }
  p.norm_eps = norm_eps;

  const mx::Dtype dtype = mixed_qkvzba.dtype();
  check_activation_dtype("mixed_qkvzba", mixed_qkvzba);
  if (mixed_qkvzba.ndim() != 3) {
    throw std::invalid_argument(
        "mixed_qkvzba must have rank 3 [B, T, F], got shape " +
        shape_string(mixed_qkvzba.shape()));
  }
  p.set_shape(
      {mixed_qkvzba.shape(0),
       mixed_qkvzba.shape(1),
       key_heads,
       value_heads,
       key_dim,
       value_dim});
  // dt_bias [Hv, Dk] makes the gates per key channel, and a as wide.
  p.per_key_gates = dt_bias.ndim() == 2;
  if (p.per_key_gates) {
    check_shape("dt_bias", dt_bias, {value_heads, key_dim}, "[Hv, Dk]");
  } else {
    check_shape("dt_bias", dt_bias, {value_heads}, "[Hv] (or [Hv, Dk])");
  }
  if (mixed_qkvzba.shape(2) != p.mixed_qkvzba_width()) {
    std::ostringstream out;
    out << "mixed_qkvzba must have last dimension F = 2*Hk*Dk + 2*Hv*Dv + Hv + "
        << (p.per_key_gates ? "Hv*Dk (a per key channel, as dt_bias)" : "Hv")
        << " = " << p.mixed_qkvzba_width()
        << " (packed [q | k | v | z | b | a] for Hk=" << key_heads
        << ", Hv=" << value_heads << ", Dk=" << key_dim << ", Dv=" << value_dim
        << "), got shape " << shape_string(mixed_qkvzba.shape());
    throw std::invalid_argument(out.str());
  }

  // conv_weight: [C, K] or mlx's Conv1d layout [C, K, 1].
  const int C = p.conv_channels();
  const bool conv1d_layout =
      conv_weight.ndim() == 3 && conv_weight.shape(2) == 1;
  if (!(conv_weight.ndim() == 2 || conv1d_layout) ||
      conv_weight.shape(0) != C || conv_weight.shape(1) < 1) {
    std::ostringstream out;
    out << "conv_weight must have shape (" << C << ", K) or (" << C
        << ", K, 1) (C = 2*Hk*Dk + Hv*Dv channels q|k|v, K >= 1), got "
        << shape_string(conv_weight.shape());
    throw std::invalid_argument(out.str());
  }
  check_floating("conv_weight", conv_weight);
  p.conv_kernel = conv_weight.shape(1);

  check_shape("decay_parameter", decay_parameter, {value_heads}, "[Hv]");
  check_shape("norm_weight", norm_weight, {value_dim}, "[Dv]");
  check_floating("decay_parameter", decay_parameter);
  check_floating("dt_bias", dt_bias);
  check_floating("norm_weight", norm_weight);

  if (conv_state) {
    check_shape(
        "conv_state",
        *conv_state,
        {p.batch, p.conv_state_rows(), C},
        "[B, K-1, C]");
    if (conv_state->dtype() != dtype) {
      throw std::domain_error(
          "conv_state must have the activation dtype of mixed_qkvzba (" +
          dtype_string(dtype) + "), got " + dtype_string(conv_state->dtype()));
    }
  }
  if (state) {
    check_state("state", *state, {p.batch, value_heads, value_dim, key_dim});
  }
  if (mask) {
    check_mask(*mask, p.batch, p.tokens);
  }
  validate_launch_extents(p.core_params());
  validate_segment_extents(p);
}

}  // namespace mlx_gated_delta
