// The segment's stages as MLX ops (segment_ops.h).
#include "segment/segment_ops.h"

#include <cmath>

#include "core/core_op.h"
#include "mlx/ops.h"
#include "segment/segment_primitive.h"

namespace mx = mlx::core;

namespace mlx_gated_delta {

const char* head_mapping_name(HeadMapping mapping) {
  return mapping == HeadMapping::Grouped ? "grouped" : "interleaved";
}

const char* algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::Recurrent:
      return "recurrent";
    case Algorithm::Chunked:
      return "chunked";
    default:
      return "auto";
  }
}

mx::array take_rows(const mx::array& a, const mx::array& rows, mx::Stream s) {
  const int B = a.shape(0);
  const int n = rows.shape(1);
  mx::array index = mx::reshape(rows, {B, n, 1}, s);
  return mx::take_along_axis(
      a, mx::broadcast_to(index, {B, n, a.shape(2)}, s), 1, s);
}

CompactPositions compact_positions(
    const SegmentParams& p,
    const std::optional<mx::array>& mask,
    mx::Stream s) {
  const int B = p.batch, T = p.tokens;
  const int history = p.conv_state_rows();
  auto row_arange = [&](int n) {
    return mx::broadcast_to(
        mx::reshape(mx::arange(n, s), {1, n}, s), {B, n}, s);
  };
  if (!mask) {
    return {row_arange(T), mx::full({B, 1}, T, mx::int32, s)};
  }
  mx::array kept = mx::astype(*mask, mx::int32, s);
  mx::array rank = mx::cumsum(kept, 1, false, false, std::nullopt, s);
  mx::array count = mx::sum(kept, 1, true, s);
  // Every masked token writes the spare slot T, which no lookup reads.
  mx::array slot = mx::where(*mask, rank, mx::array(T, mx::int32), s);
  mx::array token_of_rank = mx::slice(
      mx::put_along_axis(
          mx::zeros({B, T + 1}, mx::int32, s), slot, row_arange(T), 1, s),
      {0, 0},
      {B, T},
      s);
  mx::array state_rows = row_arange(history);
  mx::array ext_of_compact = mx::concatenate(
      {state_rows, token_of_rank + mx::array(history, mx::int32)}, 1, s);
  mx::array compact_of_ext =
      mx::concatenate({state_rows, rank + mx::array(history, mx::int32)}, 1, s);
  mx::array ext_is_kept = mx::concatenate(
      {mx::full({B, history}, true, mx::bool_, s), *mask}, 1, s);
  mx::array rank_is_kept = mx::less(row_arange(T), count, s);
  return {
      rank,
      count,
      ext_of_compact,
      compact_of_ext,
      ext_is_kept,
      token_of_rank,
      rank_is_kept};
}

ConvPart conv_part_forward(
    const SegmentParams& p,
    const CompactPositions& at,
    const std::vector<mx::array>& primals,
    int first,
    int width,
    mx::Stream s) {
  const int B = p.batch, T = p.tokens, K = p.conv_kernel;
  const int history = p.conv_state_rows();
  mx::array tokens =
      mx::slice(primals[kMixedQkvzba], {0, 0, first}, {B, T, first + width}, s);
  mx::array carried = mx::slice(
      primals[kConvState], {0, 0, first}, {B, history, first + width}, s);
  mx::array compact = mx::concatenate({carried, tokens}, 1, s);
  if (at.ext_of_compact) {
    compact = take_rows(compact, *at.ext_of_compact, s);
  }
  mx::array weight =
      mx::slice(primals[kConvWeight], {first, 0}, {first + width, K}, s);
  // Compact row r of the conv: sum_j compact[r + j] * weight[:, j].
  mx::array pre = mx::zeros({B, T, width}, mx::float32, s);
  for (int j = 0; j < K; ++j) {
    mx::array tap = mx::reshape(
        mx::slice(weight, {0, j}, {width, j + 1}, s), {1, 1, width}, s);
    pre = pre + mx::slice(compact, {0, j, 0}, {B, j + T, width}, s) * tap;
  }
  if (at.token_of_rank) {
    pre = take_rows(pre, at.rank, s);
  }
  return {compact, pre, weight};
}

mx::array mixed_columns(
    const SegmentParams& p,
    const mx::array& mixed,
    int first,
    int width,
    mx::Stream s) {
  return mx::astype(
      mx::slice(mixed, {0, 0, first}, {p.batch, p.tokens, first + width}, s),
      mx::float32,
      s);
}

std::function<std::vector<mx::array>(const std::vector<mx::array>&)>
core_function(
    const SegmentParams& p,
    Algorithm algorithm,
    const std::optional<mx::array>& mask,
    mx::Stream s) {
  return [p, algorithm, mask, s](const std::vector<mx::array>& in) {
    return gated_delta_rule(
        in[0],
        in[1],
        in[2],
        in[3],
        in[4],
        in[5],
        1.0f / std::sqrt(float(p.key_dim)),
        head_mapping_name(p.head_mapping),
        mask,
        /*normalize_qk=*/true,
        algorithm_name(algorithm),
        s);
  };
}

std::array<int, 3> conv_part_firsts(const SegmentParams& p) {
  return {0, p.qk_width(), 2 * p.qk_width()};
}

std::array<int, 3> conv_part_widths(const SegmentParams& p) {
  return {p.qk_width(), p.qk_width(), p.v_width()};
}

CoreInputs core_inputs(
    const SegmentParams& p,
    const std::optional<mx::array>& mask,
    const std::vector<mx::array>& primals,
    mx::Stream s) {
  const int B = p.batch, T = p.tokens;
  const int Hk = p.key_heads, Hv = p.value_heads;
  const int Dk = p.key_dim, Dv = p.value_dim;
  const mx::array& mixed = primals[kMixedQkvzba];
  CompactPositions at = compact_positions(p, mask, s);
  std::vector<ConvPart> parts;
  for (int i = 0; i < 3; ++i) {
    parts.push_back(conv_part_forward(
        p, at, primals, conv_part_firsts(p)[i], conv_part_widths(p)[i], s));
  }
  auto act = [&](int i) { return parts[i].pre * mx::sigmoid(parts[i].pre, s); };
  const mx::array& decay_parameter = primals[kDecayParameter];
  mx::array rate = p.decay_parameterization == DecayParameterization::LogRate
      ? mx::negative(mx::exp(decay_parameter, s), s)
      : decay_parameter;
  const mx::Shape gate_shape =
      p.per_key_gates ? mx::Shape{B, T, Hv, Dk} : mx::Shape{B, T, Hv};
  if (p.per_key_gates) {
    rate = mx::reshape(rate, {Hv, 1}, s);
  }
  mx::array gate_input =
      mx::reshape(
          mixed_columns(p, mixed, p.a_offset(), p.gate_width(), s),
          gate_shape,
          s) +
      primals[kDtBias];
  const bool bounded = p.gates.has_lower_bound;
  mx::array decay_sigmoid =
      mx::sigmoid(bounded ? mx::negative(rate, s) * gate_input : gate_input, s);
  mx::array softplus = mx::logaddexp(gate_input, mx::array(0.0f), s);
  mx::array b_sigmoid =
      mx::sigmoid(mixed_columns(p, mixed, p.b_offset(), Hv, s), s);
  const float beta_scale = p.gates.allow_neg_eigval ? 2.0f : 1.0f;
  std::vector<mx::array> core_primals = {
      mx::reshape(act(0), {B, T, Hk, Dk}, s),
      mx::reshape(act(1), {B, T, Hk, Dk}, s),
      mx::reshape(act(2), {B, T, Hv, Dv}, s),
      bounded ? mx::array(p.gates.lower_bound) * decay_sigmoid
              : rate * softplus,
      mx::array(beta_scale) * b_sigmoid,
      primals[kState]};
  return {
      std::move(at),
      std::move(parts),
      rate,
      gate_input,
      decay_sigmoid,
      softplus,
      b_sigmoid,
      std::move(core_primals)};
}

namespace {

// The conv state after the first `kept` unmasked tokens of each row
// ([B, 1], int32): the compact rows kept .. kept+K-2 of every channel.
mx::array conv_state_after(
    const SegmentParams& p,
    const mx::array& compact,
    const mx::array& kept,
    mx::Stream s) {
  const int history = p.conv_state_rows();
  mx::array rows = kept + mx::reshape(mx::arange(history, s), {1, history}, s);
  return take_rows(compact, mx::astype(rows, mx::int32, s), s);
}

}  // namespace

std::vector<mx::array> segment_as_ops(
    const SegmentParams& p,
    Algorithm algorithm,
    const std::vector<mx::array>& primals,
    const std::optional<mx::array>& mask,
    const std::vector<int>& checkpoints,
    mx::Stream s) {
  const int B = p.batch, T = p.tokens, C = p.conv_channels();
  const int Hv = p.value_heads, Dv = p.value_dim;
  const int history = p.conv_state_rows();
  const mx::array& mixed = primals[kMixedQkvzba];
  const mx::Dtype dtype = mixed.dtype();
  const CoreInputs in = core_inputs(p, mask, primals, s);
  const std::vector<mx::array>& c = in.core_primals;

  std::optional<mx::array> positions;
  if (!checkpoints.empty()) {
    positions =
        mx::array(checkpoints.data(), {int(checkpoints.size())}, mx::int32);
  }
  std::vector<mx::array> core = gated_delta_rule(
      c[0],
      c[1],
      c[2],
      c[3],
      c[4],
      c[5],
      1.0f / std::sqrt(float(p.key_dim)),
      head_mapping_name(p.head_mapping),
      mask,
      /*normalize_qk=*/true,
      algorithm_name(algorithm),
      s,
      {},
      positions);

  // out = rms_norm(y) * norm_weight * o(z), o the output gate (SiLU or
  // sigmoid); a masked token's row is 0.
  const mx::array& y = core[0];
  mx::array z = mx::reshape(
      mixed_columns(p, mixed, p.z_offset(), p.v_width(), s), {B, T, Hv, Dv}, s);
  mx::array n = y *
      mx::rsqrt(mx::mean(mx::square(y, s), -1, true, s) + mx::array(p.norm_eps),
                s);
  mx::array z_sigmoid = mx::sigmoid(z, s);
  mx::array gate =
      p.gates.output_gate == OutputGate::Sigmoid ? z_sigmoid : z * z_sigmoid;
  mx::array out = n * primals[kNormWeight] * gate;
  if (mask) {
    out =
        mx::where(mx::reshape(*mask, {B, T, 1, 1}, s), out, mx::array(0.0f), s);
  }

  // The conv states: rows of the compact sequence of all C channels.
  mx::array compact = mx::concatenate(
      {primals[kConvState], mx::slice(mixed, {0, 0, 0}, {B, T, C}, s)}, 1, s);
  if (in.at.ext_of_compact) {
    compact = take_rows(compact, *in.at.ext_of_compact, s);
  }
  std::vector<mx::array> outputs = {
      mx::astype(out, dtype, s),
      history > 0 ? conv_state_after(p, compact, in.at.count, s)
                  : primals[kConvState],
      core[1]};
  if (positions) {
    // Unmasked tokens among the first `position` tokens of each row.
    std::vector<mx::array> conv_states;
    for (int position : checkpoints) {
      mx::array kept = mask
          ? mx::sum(
                mx::astype(
                    mx::slice(*mask, {0, 0}, {B, position}, s), mx::int32, s),
                1,
                true,
                s)
          : mx::full({B, 1}, position, mx::int32, s);
      conv_states.push_back(
          history > 0 ? conv_state_after(p, compact, kept, s)
                      : primals[kConvState]);
    }
    outputs.push_back(mx::stack(conv_states, 0, s));
    outputs.push_back(core[2]);
  }
  return outputs;
}

}  // namespace mlx_gated_delta
