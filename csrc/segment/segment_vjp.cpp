// The segment's gradient (GatedDeltaSegment::vjp).
//
// The backward runs the segment's stages around the core's own backward,
// which stays the one source of the recurrence's gradient (one saved state
// per 64 tokens, not one per token):
//   1. recompute q, k, v (causal depthwise conv with the carried conv state
//      and the skip semantics of the mask, then SiLU), g and beta;
//   2. recompute y through the core's forward, and take the gated RMSNorm's
//      gradient (dy, dz, d norm_weight);
//   3. the core's backward (gated_delta_rule's vjp): dq, dk, dv, dg, dbeta
//      and dstate;
//   4. the conv's and the gates' gradients into the packed row, the conv
//      weight, the conv state, the decay parameter and dt_bias.
// On the CPU, the four steps are one kernel call
// (segment_backward_primitives.h), calling the core's CPU kernels
// (cpu::gated_delta_forward and cpu::gated_delta_backward, the kernels of
// the core op's primitives) directly: step 1 writes q, k and v where dq, dk
// and dv go and the core's backward overwrites them, dy overwrites y, and dz
// goes straight into the packed row's gradient, so the backward holds the
// gradients but neither q, k, v nor y beside them, and no float32
// temporaries of an MLX op per elementwise step. On other streams they are
// MLX ops (segment_ops.h) around the core op's backward primitive, per part
// q, k, v so that no [B, T, F] float32 copy of the packed row is made, with
// the conv's gradient as K shifted multiply-adds like its forward (no
// [B, T, K, C] window tensor and no scatter-add).
//
// Measured (benchmarks/RESULTS.md, "Training"; CPU, bf16, the Qwen3-Next
// layer's shape, T = 8192): the vjp alone grows MLX's peak by 224 MiB over
// its inputs: the packed row's gradient (193 MiB) and the float32 q, k, v and
// y (then dq, dk, dv and dy) of one wave of key heads (cpu/segment.h: 24 MiB
// on 2 threads), where every head's at once grew it by 588 MiB, and steps
// 1, 2 and 4 as three primitives around the core op's backward primitive by
// 1036 MiB (float32 q, k, v and y, 384 MiB, and dz, 64 MiB, held beside the
// gradients); the MLX vjp of the segment written as MLX ops peaked at 7315
// MiB.
#include <cmath>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>

#include "core/core_op.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "segment/segment_backward_primitives.h"
#include "segment/segment_ops.h"
#include "segment/segment_primitive.h"

namespace mx = mlx::core;

namespace mlx_gated_delta {

namespace {

// d silu(x) / dx from x and sig = sigmoid(x).
mx::array silu_derivative(const mx::array& x, const mx::array& sig) {
  return sig * (mx::array(1.0f) + x * (mx::array(1.0f) - sig));
}

// The gradients of one conv part from the gradient of its SiLU output
// `d_act` [B, T, W] and the cotangent of its conv-state columns `d_carried_out`
// [B, K-1, W]: {d_tokens [B, T, W] and d_conv_state [B, K-1, W] in the
// activation dtype, d_weight [W, K] float32}.
std::vector<mx::array> conv_part_backward(
    const SegmentParams& p,
    const CompactPositions& at,
    const ConvPart& part,
    const mx::array& d_act,
    const mx::array& d_carried_out,
    mx::Dtype dtype,
    mx::Stream s) {
  const int B = p.batch, T = p.tokens, K = p.conv_kernel;
  const int history = p.conv_state_rows();
  const int length = history + T;
  const int width = part.pre.shape(2);
  mx::array d_pre = d_act * silu_derivative(part.pre, mx::sigmoid(part.pre, s));
  if (at.token_of_rank) {  // per compact row: its token's, 0 past the count
    d_pre = mx::where(
        mx::reshape(*at.rank_is_kept, {B, T, 1}, s),
        take_rows(d_pre, *at.token_of_rank, s),
        mx::array(0.0f),
        s);
  }
  // d_compact[c] = sum_j d_pre[c - j] * weight[:, j], over 0 <= c - j < T.
  mx::array padded = mx::pad(
      d_pre,
      std::vector<int>{1},
      mx::Shape{K - 1},
      mx::Shape{K - 1},
      mx::array(0.0f),
      "constant",
      s);
  mx::array d_compact = mx::zeros({B, length, width}, mx::float32, s);
  std::vector<mx::array> d_taps;
  for (int j = 0; j < K; ++j) {
    mx::array tap = mx::reshape(
        mx::slice(part.weight, {0, j}, {width, j + 1}, s), {1, 1, width}, s);
    mx::array shifted =
        mx::slice(padded, {0, K - 1 - j, 0}, {B, K - 1 - j + length, width}, s);
    d_compact = d_compact + shifted * tap;
    mx::array window = mx::slice(part.compact, {0, j, 0}, {B, j + T, width}, s);
    d_taps.push_back(mx::reshape(
        mx::sum(d_pre * window, std::vector<int>{0, 1}, false, s),
        {width, 1},
        s));
  }
  // The new conv state is the compact rows count .. count+K-2.
  if (history > 0) {
    mx::array offsets = mx::reshape(mx::arange(history, s), {1, history}, s);
    mx::array rows = mx::broadcast_to(
        mx::reshape(at.count + offsets, {B, history, 1}, s),
        {B, history, width},
        s);
    d_compact = mx::scatter_add_axis(
        d_compact, rows, mx::astype(d_carried_out, mx::float32, s), 1, s);
  }
  mx::array d_ext = d_compact;
  if (at.compact_of_ext) {
    d_ext = mx::where(
        mx::reshape(*at.ext_is_kept, {B, length, 1}, s),
        take_rows(d_compact, *at.compact_of_ext, s),
        mx::array(0.0f),
        s);
  }
  d_ext = mx::astype(d_ext, dtype, s);
  return {
      mx::slice(d_ext, {0, history, 0}, {B, length, width}, s),
      mx::slice(d_ext, {0, 0, 0}, {B, history, width}, s),
      mx::concatenate(d_taps, 1, s)};
}

// Steps 2 and 3 (see the top of this file) as MLX ops: from the core's
// inputs, the core's gradients {dq, dk, dv, dg, dbeta, dstate}, then the
// gated norm's dz [B, T, Hv*Dv] and d norm_weight (float32).
std::vector<mx::array> norm_and_core_gradients(
    const SegmentParams& p,
    Algorithm algorithm,
    const std::optional<mx::array>& mask,
    const std::vector<mx::array>& core_primals,
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    mx::Stream s) {
  const int B = p.batch, T = p.tokens, Hv = p.value_heads, Dv = p.value_dim;
  const auto core = core_function(p, algorithm, mask, s);
  // out = n * w * o(z) with n = y * inv_rms and o the output gate.
  mx::array y = core(core_primals)[0];
  mx::array z = mx::reshape(
      mixed_columns(p, primals[kMixedQkvzba], p.z_offset(), p.v_width(), s),
      {B, T, Hv, Dv},
      s);
  mx::array d_out = mx::astype(cotangents[0], mx::float32, s);
  if (mask) {
    d_out = mx::where(
        mx::reshape(*mask, {B, T, 1, 1}, s), d_out, mx::array(0.0f), s);
  }
  mx::array inv_rms = mx::rsqrt(
      mx::mean(mx::square(y, s), -1, true, s) + mx::array(p.norm_eps), s);
  mx::array n = y * inv_rms;
  mx::array z_sigmoid = mx::sigmoid(z, s);
  const bool sigmoid_gate = p.gates.output_gate == OutputGate::Sigmoid;
  mx::array gate = sigmoid_gate ? z_sigmoid : z * z_sigmoid;
  mx::array d_gate = sigmoid_gate ? z_sigmoid * (mx::array(1.0f) - z_sigmoid)
                                  : silu_derivative(z, z_sigmoid);
  const mx::array& norm_weight = primals[kNormWeight];
  mx::array d_norm_weight =
      mx::sum(d_out * n * gate, std::vector<int>{0, 1, 2}, false, s);
  mx::array d_z = d_out * n * norm_weight * d_gate;
  mx::array d_n = d_out * norm_weight * gate;
  mx::array d_y = inv_rms * (d_n - n * mx::mean(d_n * n, -1, true, s));

  auto [_, d_core] = mx::vjp(core, core_primals, {d_y, cotangents[2]});
  d_core.push_back(mx::reshape(d_z, {B, T, p.v_width()}, s));
  d_core.push_back(d_norm_weight);
  return d_core;
}

// Every differentiable input's gradient, in kMixedQkvzba .. kState order,
// through the CPU kernel.
std::vector<mx::array> segment_gradients_cpu(
    const SegmentParams& p,
    Algorithm algorithm,
    const std::optional<mx::array>& mask,
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    mx::Stream s) {
  const mx::Dtype dtype = primals[kMixedQkvzba].dtype();
  // The kernel reads every input row-contiguous.
  const auto cotangent = [&](int i, mx::Dtype as) {
    return mx::contiguous(mx::astype(cotangents[i], as, s), false, s);
  };
  std::vector<mx::array> inputs = {
      primals[kMixedQkvzba],
      primals[kConvWeight],
      primals[kDecayParameter],
      primals[kDtBias],
      primals[kNormWeight],
      primals[kConvState],
      primals[kState],
      cotangent(0, dtype),
      cotangent(1, dtype),
      cotangent(2, mx::float32)};
  if (mask) {
    inputs.push_back(*mask);
  }
  auto vjp = std::make_shared<GatedDeltaSegmentVJP>(s, p, algorithm);
  const std::vector<mx::array> d = mx::array::make_arrays(
      vjp->output_shapes(inputs), segment_vjp_dtypes(dtype), vjp, inputs);
  return {
      d[kVJPDMixed],
      mx::sum(d[kVJPDConvWeightRows], 0, false, s),
      mx::sum(d[kVJPDDecayParameterRows], 0, false, s),
      mx::reshape(
          mx::sum(d[kVJPDDtBiasRows], 0, false, s),
          primals[kDtBias].shape(),
          s),
      mx::sum(d[kVJPDNormWeightRows], 0, false, s),
      d[kVJPDConvState],
      d[kVJPDState]};
}

// Every differentiable input's gradient, in kMixedQkvzba .. kState order, as
// MLX ops on any stream.
std::vector<mx::array> segment_gradients(
    const SegmentParams& p,
    Algorithm algorithm,
    const std::optional<mx::array>& mask,
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    mx::Stream s) {
  const int B = p.batch, T = p.tokens, Hv = p.value_heads;
  const int history = p.conv_state_rows();
  const mx::Dtype dtype = primals[kMixedQkvzba].dtype();

  // 1. The conv, SiLU and the gates.
  const CoreInputs in = core_inputs(p, mask, primals, s);
  const CompactPositions& at = in.at;
  const std::vector<ConvPart>& parts = in.parts;
  const std::vector<mx::array>& core_primals = in.core_primals;
  const mx::array& rate = in.rate;
  const mx::array& gate_input = in.gate_input;
  const mx::array& decay_sigmoid = in.decay_sigmoid;
  const mx::array& softplus = in.softplus;
  const mx::array& b_sigmoid = in.b_sigmoid;
  const std::array<int, 3> firsts = conv_part_firsts(p);
  const std::array<int, 3> widths = conv_part_widths(p);
  const bool log_rate =
      p.decay_parameterization == DecayParameterization::LogRate;
  const bool bounded = p.gates.has_lower_bound;
  const mx::array lower_bound(p.gates.lower_bound);
  const float beta_scale = p.gates.allow_neg_eigval ? 2.0f : 1.0f;

  // 2 and 3.
  const std::vector<mx::array> d = norm_and_core_gradients(
      p, algorithm, mask, core_primals, primals, cotangents, s);
  const mx::array& d_g = d[3];

  // 4. The gates' and the conv's gradients.
  mx::array d_gate_input = d_g * rate * decay_sigmoid;
  mx::array d_g_d_rate = softplus;
  if (bounded) {
    mx::array scaled =
        lower_bound * decay_sigmoid * (mx::array(1.0f) - decay_sigmoid);
    d_gate_input = d_g * mx::negative(rate, s) * scaled;
    d_g_d_rate = mx::negative(gate_input, s) * scaled;
  }
  // Summed over the batch, the tokens and (per key) the key channels.
  mx::array d_rate = mx::sum(
      mx::reshape(d_g * d_g_d_rate, {B * T, Hv, -1}, s),
      std::vector<int>{0, 2},
      false,
      s);
  mx::array d_decay_parameter =
      log_rate ? d_rate * mx::reshape(rate, {Hv}, s) : d_rate;
  mx::array d_dt_bias = mx::sum(d_gate_input, std::vector<int>{0, 1}, false, s);
  mx::array d_b =
      d[4] * mx::array(beta_scale) * b_sigmoid * (mx::array(1.0f) - b_sigmoid);

  const mx::array& d_conv_state_out = cotangents[1];
  std::vector<mx::array> d_tokens, d_carried, d_weight;
  for (int i = 0; i < 3; ++i) {
    mx::array d_act = mx::reshape(d[i], {B, T, widths[i]}, s);
    mx::array d_carried_out = mx::slice(
        d_conv_state_out,
        {0, 0, firsts[i]},
        {B, history, firsts[i] + widths[i]},
        s);
    auto d_part =
        conv_part_backward(p, at, parts[i], d_act, d_carried_out, dtype, s);
    d_tokens.push_back(d_part[0]);
    d_carried.push_back(d_part[1]);
    d_weight.push_back(d_part[2]);
  }
  d_tokens.push_back(mx::astype(d[6], dtype, s));
  d_tokens.push_back(mx::astype(d_b, dtype, s));
  d_tokens.push_back(mx::astype(
      mx::reshape(d_gate_input, {B, T, p.gate_width()}, s), dtype, s));
  return {
      mx::concatenate(d_tokens, 2, s),
      mx::concatenate(d_weight, 0, s),
      d_decay_parameter,
      d_dt_bias,
      d[7],
      mx::concatenate(d_carried, 2, s),
      d[5]};
}

}  // namespace

std::vector<mx::array> GatedDeltaSegment::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  if (has_checkpoints_) {
    throw std::invalid_argument(
        "mlx_gated_delta.gated_delta_segment: no gradient through a call with "
        "checkpoints (serving calls); differentiate a call without them.");
  }
  const SegmentParams p = params_for(primals);
  const mx::Stream s = stream();
  if (p.batch == 0) {
    // No batch row: every gradient is zero (the weights saw no data).
    std::vector<mx::array> zeros;
    for (int arg : argnums) {
      zeros.push_back(mx::zeros_like(primals[arg], s));
    }
    return zeros;
  }
  const std::optional<mx::array> mask =
      has_mask_ ? std::optional(primals[kMask]) : std::nullopt;
  const std::vector<mx::array> grads = s.device == mx::Device::cpu
      ? segment_gradients_cpu(p, algorithm_, mask, primals, cotangents, s)
      : segment_gradients(p, algorithm_, mask, primals, cotangents, s);
  std::vector<mx::array> result;
  for (int arg : argnums) {
    result.push_back(
        arg < kMask ? grads[arg] : mx::zeros_like(primals[arg], s));
  }
  return result;
}

}  // namespace mlx_gated_delta
