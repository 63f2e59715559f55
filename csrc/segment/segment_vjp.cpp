// The segment's gradient (GatedDeltaSegment::vjp).
//
// The vjp re-expresses the segment's forward as a composition of MLX ops
// around the core op and returns the vjp of that composition:
//   causal depthwise conv with the carried conv state and the skip semantics
//   of the mask, SiLU, the gates, the core recurrence (gated_delta_rule, with
//   q/k L2-normalized inside it), the gated RMSNorm.
// Everything but the recurrence is elementwise or a gather, whose MLX
// gradients are exact and cheap; the recurrence, the only heavy part, goes
// through the core op's own backward primitive (one saved state per 64
// tokens, not one per token). A dedicated fused backward kernel would save
// the recomputation of the conv and the norms, a small fraction of the work;
// this keeps a single source of truth for the math that the gradient tests
// check against the float64 oracle. On the GPU the core's backward raises
// (no Metal backward kernels yet) and asks for stream=mx.cpu.
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>

#include "core/core_op.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "segment/segment_primitive.h"

namespace mx = mlx::core;

namespace mlx_gated_delta {

namespace {

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

// Row indices into the extended sequence ext = [conv_state rows; tokens]
// ([B, K-1+T] per row) of the elements the skip semantics puts at "compact"
// positions: compact position c < K-1 is conv_state row c, and compact
// position K-1+r is the r-th unmasked token of the row. Masked tokens have
// no compact position, so they enter no conv window.
class CompactIndex {
 public:
  CompactIndex(
      const SegmentParams& p,
      const std::optional<mx::array>& mask,
      mx::Stream s)
      : p_(p), mask_(mask), s_(s) {
    const int T = p.tokens;
    if (mask) {
      mx::array valid = mx::astype(*mask, mx::int32, s);
      // rank[b, t]: unmasked tokens before t (exclusive count).
      rank_ = mx::cumsum(valid, 1, false, false, std::nullopt, s);
      count_ = mx::sum(valid, 1, true, s);  // [B, 1]
      // token_of_rank[b, r]: the token of rank r; masked tokens all write
      // the spare slot T, which no lookup reads.
      mx::array slot = mx::where(*mask, rank_, mx::array(T, mx::int32), s);
      mx::array tokens = mx::broadcast_to(
          mx::reshape(mx::arange(T, s), {1, T}, s), {p.batch, T}, s);
      token_of_rank_ = mx::put_along_axis(
          mx::zeros({p.batch, T + 1}, mx::int32, s), slot, tokens, 1, s);
    } else {
      rank_ = mx::broadcast_to(
          mx::reshape(mx::arange(T, s), {1, T}, s), {p.batch, T}, s);
      count_ = mx::full({p.batch, 1}, T, mx::int32, s);
    }
  }

  // ext rows of compact positions `c` ([B, n], int32, every c in
  // [0, K-1 + unmasked count)).
  mx::array ext_rows(const mx::array& c) const {
    if (!mask_) {
      return c;
    }
    const int history = p_.conv_state_rows();
    mx::array r = mx::maximum(c - history, mx::array(0, mx::int32), s_);
    mx::array token = mx::take_along_axis(token_of_rank_, r, 1, s_);
    return mx::where(
        mx::less(c, mx::array(history, mx::int32), s_), c, token + history, s_);
  }

  // Compact position of the newest input of token t's window: K-1 + rank.
  const mx::array& rank() const {
    return rank_;
  }
  const mx::array& count() const {
    return count_;
  }

 private:
  SegmentParams p_;
  std::optional<mx::array> mask_;
  mx::Stream s_;
  mx::array rank_ = mx::array(0);
  mx::array count_ = mx::array(0);
  mx::array token_of_rank_ = mx::array(0);
};

// Rows `rows` ([B, n], indices into each batch row's ext) of ext [B, L, C],
// as [B, n, C]: one gather over the flattened rows (the index does not
// depend on the channel).
mx::array gather_rows(
    const mx::array& ext, const mx::array& rows, mx::Stream s) {
  const int B = ext.shape(0);
  const int L = ext.shape(1);
  const int C = ext.shape(2);
  const int n = rows.shape(1);
  mx::array base = mx::reshape(mx::arange(0, B * L, L, s), {B, 1}, s);
  mx::array flat = mx::reshape(rows + base, {B * n}, s);
  return mx::reshape(
      mx::take(mx::reshape(ext, {B * L, C}, s), flat, 0, s), {B, n, C}, s);
}

// The segment's forward as MLX ops (see the top of this file). `primals`
// are the primitive's differentiable inputs (mixed_qkvzba ... state); returns
// {out, conv_state, state} in the primitive's output dtypes.
std::vector<mx::array> segment_composition(
    const SegmentParams& p,
    Algorithm algorithm,
    const std::optional<mx::array>& mask,
    const std::vector<mx::array>& primals,
    mx::Stream s) {
  const int B = p.batch, T = p.tokens, K = p.conv_kernel;
  const int C = p.conv_channels();
  const int Hk = p.key_heads, Hv = p.value_heads;
  const int Dk = p.key_dim, Dv = p.value_dim;
  const mx::Dtype dtype = primals[kMixedQkvzba].dtype();

  mx::array x = mx::astype(primals[kMixedQkvzba], mx::float32, s);
  auto part = [&](int start, int width) {
    return mx::slice(x, {0, 0, start}, {B, T, start + width}, s);
  };
  mx::array conv_state = mx::astype(primals[kConvState], mx::float32, s);
  mx::array ext =
      mx::concatenate({conv_state, part(0, C)}, 1, s);  // [B, K-1+T, C]

  // The causal depthwise conv over compact positions: tap j of token t
  // reads compact position rank + j (tap K-1 is the token itself).
  const CompactIndex index(p, mask, s);
  mx::array conv = mx::zeros({B, T, C}, mx::float32, s);
  for (int j = 0; j < K; ++j) {
    mx::array rows = index.ext_rows(index.rank() + j);
    mx::array tap = mx::slice(primals[kConvWeight], {0, j}, {C, j + 1}, s);
    conv = conv + gather_rows(ext, rows, s) * mx::reshape(tap, {1, 1, C}, s);
  }
  mx::array qkv = conv * mx::sigmoid(conv, s);

  // The new conv state: the last K-1 compact positions.
  mx::array conv_state_out = primals[kConvState];
  if (K > 1) {
    mx::array offsets = mx::reshape(mx::arange(K - 1, s), {1, K - 1}, s);
    conv_state_out = mx::astype(
        gather_rows(ext, index.ext_rows(index.count() + offsets), s), dtype, s);
  }

  const int qk_width = p.qk_width();
  mx::array q = mx::reshape(
      mx::slice(qkv, {0, 0, 0}, {B, T, qk_width}, s), {B, T, Hk, Dk}, s);
  mx::array k = mx::reshape(
      mx::slice(qkv, {0, 0, qk_width}, {B, T, 2 * qk_width}, s),
      {B, T, Hk, Dk},
      s);
  mx::array v = mx::reshape(
      mx::slice(qkv, {0, 0, 2 * qk_width}, {B, T, C}, s), {B, T, Hv, Dv}, s);

  const mx::array& decay_parameter = primals[kDecayParameter];
  mx::array rate = p.decay_parameterization == DecayParameterization::LogRate
      ? mx::negative(mx::exp(decay_parameter, s), s)
      : decay_parameter;
  mx::array a = part(p.a_offset(), Hv) + primals[kDtBias];
  mx::array g = rate * mx::logaddexp(a, mx::array(0.0f), s);  // rate * softplus
  mx::array beta = mx::sigmoid(part(p.b_offset(), Hv), s);

  auto core = gated_delta_rule(
      q,
      k,
      v,
      g,
      beta,
      primals[kState],
      1.0f / std::sqrt(float(Dk)),
      head_mapping_name(p.head_mapping),
      mask,
      /*normalize_qk=*/true,
      algorithm_name(algorithm),
      s);
  const mx::array& y = core[0];  // float32: q, k and v are

  mx::array z = mx::reshape(part(p.z_offset(), p.v_width()), {B, T, Hv, Dv}, s);
  mx::array inv_rms = mx::rsqrt(
      mx::mean(mx::square(y, s), -1, true, s) + mx::array(p.norm_eps), s);
  mx::array out = y * inv_rms * primals[kNormWeight] * (z * mx::sigmoid(z, s));
  if (mask) {
    out =
        mx::where(mx::reshape(*mask, {B, T, 1, 1}, s), out, mx::array(0.0f), s);
  }
  return {mx::astype(out, dtype, s), conv_state_out, core[1]};
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
  if (p.batch == 0) {
    // No batch row: every gradient is zero (the weights saw no data). The
    // composition's row gather would differentiate into a scatter over an
    // empty array, which MLX rejects.
    std::vector<mx::array> zeros;
    for (int arg : argnums) {
      zeros.push_back(mx::zeros_like(primals[arg], stream()));
    }
    return zeros;
  }
  const std::optional<mx::array> mask =
      has_mask_ ? std::optional(primals[kMask]) : std::nullopt;
  const Algorithm algorithm = algorithm_;
  const mx::Stream s = stream();
  auto composition = [p, algorithm, mask, s](const std::vector<mx::array>& in) {
    return segment_composition(p, algorithm, mask, in, s);
  };
  const std::vector<mx::array> differentiable(
      primals.begin(), primals.begin() + kMask);
  auto [_, grads] = mx::vjp(composition, differentiable, cotangents);
  std::vector<mx::array> result;
  for (int arg : argnums) {
    result.push_back(
        arg < kMask ? grads[arg] : mx::zeros_like(primals[arg], s));
  }
  return result;
}

}  // namespace mlx_gated_delta
