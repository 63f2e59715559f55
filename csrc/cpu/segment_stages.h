// The stages of the fused layer segment (segment.h) on the CPU, in the
// namespace of the kernels' compiled level (kernel_level.h).
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/segment_common.h"
#include "segment/segment_params.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

// Where prepare_conv writes q, k and v: the row of token index r (b * T + t)
// of part i (0, 1, 2: q, k, v) starts at part[i] + r * row_stride[i]. The
// forward writes the three as column ranges of one [B, T, C] buffer, the
// backward's recomputation as three arrays.
struct ConvOutputs {
  float* part[3];
  int64_t row_stride[3];
};

// q|k|v[b, t, :] = silu(sum_i window_i * conv_weight[:, i]) over the last K
// unmasked inputs of row b (the carried conv state first), float32, for the
// channels of `blocks` (channel_blocks: all of them, or those of some heads,
// each block's `column` counted in its part of `out`). A masked token is
// skipped: it is not in any window and its rows are 0.
template <typename T>
void prepare_conv(
    const SegmentParams& params,
    const T* mixed,  // [B, T, F]
    const float* conv_weight,  // [C, K]
    const T* conv_state,  // [B, K-1, C]
    const bool* mask,  // [B, T] or nullptr
    const std::vector<ChannelBlock>& blocks,
    const ConvOutputs& out);

// The new conv state: the last K-1 unmasked pre-conv inputs of each row,
// reaching back into the carried conv state when the call has fewer.
template <typename T>
void collect_conv_state(
    const SegmentParams& params,
    const T* mixed,  // [B, T, F]
    const T* conv_state_in,  // [B, K-1, C]
    const bool* mask,  // [B, T] or nullptr
    T* conv_state_out);  // [B, K-1, C]

// The conv state after each checkpoint's first tokens of the call (the
// conv state collect_conv_state would return for a call cut there).
template <typename T>
void collect_conv_checkpoints(
    const SegmentParams& params,
    const T* mixed,  // [B, T, F]
    const T* conv_state_in,  // [B, K-1, C]
    const bool* mask,  // [B, T] or nullptr
    const int* checkpoints,  // [N]
    T* conv_checkpoint_states);  // [N, B, K-1, C]

// g = rate * softplus(a + dt_bias) (log-space decay), or with a lower bound
// lower_bound * sigmoid(-rate * (a + dt_bias)), per value head or per value
// head and key channel; beta = sigmoid(b), times 2 with allow_neg_eigval;
// for the value heads [first_head, first_head + heads) (H of them below).
template <typename T>
void prepare_gates(
    const SegmentParams& params,
    const T* mixed,  // [B, T, F]
    const float* decay_parameter,  // [Hv]
    const float* dt_bias,  // [Hv], or [Hv, Dk] with per-key gates
    int first_head,
    int heads,
    float* g,  // [B, T, H], or [B, T, H, Dk] with per-key gates
    float* beta);  // [B, T, H]

// One wave's inputs to the core, as the forward computes them and the
// backward recomputes them: q, k and v of the key heads [first_key_head,
// first_key_head + key_heads) and of the value heads that read them
// (prepare_conv, into conv_out), their g and beta (prepare_gates) and, when
// the call has an initial state and `wave_state_in` is given, their states
// ([B, H, Dv, Dk]; null: the core reads io's own). `io` is the
// forward's or the backward's buffers (segment.h), which name the inputs
// alike.
template <typename Buffers>
void prepare_wave(
    const SegmentParams& p,
    const Buffers& io,
    int first_key_head,
    int key_heads,
    const ConvOutputs& conv_out,
    float* g,
    float* beta,
    float* wave_state_in) {
  const int ratio = p.value_heads / p.key_heads;
  const int first_head = first_key_head * ratio, heads = key_heads * ratio;
  prepare_conv(
      p,
      io.mixed_qkvzba,
      io.conv_weight,
      io.conv_state_in,
      io.mask,
      channel_blocks(p, first_key_head, key_heads),
      conv_out);
  prepare_gates(
      p,
      io.mixed_qkvzba,
      io.decay_parameter,
      io.dt_bias,
      first_head,
      heads,
      g,
      beta);
  if (io.state_in != nullptr && wave_state_in != nullptr) {
    copy_wave_states(
        p, p.batch, first_head, heads, io.state_in, wave_state_in, true);
  }
}

// out = rms_norm(y, eps) * norm_weight * silu(z) (or sigmoid(z), as the
// params' output gate), per (token, value head), for the value heads
// [first_head, first_head + heads) (H of them); masked tokens get 0.
template <typename T>
void gated_norm(
    const SegmentParams& params,
    int first_head,
    int heads,
    const float* y,  // [B, T, H, Dv]
    const T* mixed,  // [B, T, F] (z is read from here)
    const float* norm_weight,  // [Dv]
    const bool* mask,  // [B, T] or nullptr
    T* out);  // [B, T, Hv, Dv]

// The backward's stages (segment_backward.cpp), in reverse order.

// The gradient of gated_norm for the value heads [first_head, first_head +
// heads) (H of them): dy [B, T, H, Dv] (float32; may be y itself: each
// element of y is read before its dy is written), dz (activation dtype) into
// rows of H*Dv values `d_z_row_stride` apart (those heads' z columns of the
// packed row's gradient), and d norm_weight, added in double to
// `d_norm_weight_tasks` [tasks, Dv] (one row per batch row and block of
// tokens; segment_backward.cpp sums them per batch row). A masked token's
// cotangent counts as 0.
template <typename T>
void gated_norm_backward(
    const SegmentParams& params,
    int first_head,
    int heads,
    const float* y,  // [B, T, H, Dv]
    const T* mixed,  // [B, T, F] (z is read from here)
    const float* norm_weight,  // [Dv]
    const T* d_out,  // [B, T, Hv, Dv]
    const bool* mask,  // [B, T] or nullptr
    float* d_y,
    T* d_z,
    int64_t d_z_row_stride,
    double* d_norm_weight_tasks);

// The gradients prepare_conv and prepare_gates receive, of some heads (as
// prepare_conv and prepare_gates wrote them), and what their backward gives
// per batch row (the caller sums the rows, so that vmap folds its mapped axis
// into the batch).
struct PrepareGradients {
  const float* dq;  // [B, T, Hk', Dk]
  const float* dk;  // [B, T, Hk', Dk]
  const float* dv;  // [B, T, Hv', Dv]
  int64_t row_stride[3];  // between token rows of dq, dk and dv
  const float* dg;  // as g, of the heads
  const float* dbeta;  // [B, T, Hv'], of the heads
  float* d_weight_rows;  // [B, C, K]
  float* d_decay_rows;  // [B, Hv]
  float* d_dt_bias_rows;  // [B, Hv], or [B, Hv*Dk] with per-key gates
};

// The gradient of prepare_conv and collect_conv_state into the packed rows'
// q|k|v columns (0 for a masked token), the conv state and the conv weight,
// for the channels of `blocks` (as prepare_conv's; each block's `column`
// counted in its part of grad's dq, dk, dv).
template <typename T>
void prepare_conv_backward(
    const SegmentParams& params,
    const T* mixed,  // [B, T, F]
    const float* conv_weight,  // [C, K]
    const T* conv_state,  // [B, K-1, C]
    const T* d_conv_state_out,  // [B, K-1, C]
    const bool* mask,  // [B, T] or nullptr
    const std::vector<ChannelBlock>& blocks,
    const PrepareGradients& grad,
    T* d_mixed,  // [B, T, F]
    T* d_conv_state);  // [B, K-1, C]

// The gradient of prepare_gates into the packed rows' b and a columns, the
// decay parameter and dt_bias, for the value heads [first_head, first_head +
// heads) (grad's dg and dbeta are theirs).
template <typename T>
void prepare_gates_backward(
    const SegmentParams& params,
    const T* mixed,  // [B, T, F]
    const float* decay_parameter,  // [Hv]
    const float* dt_bias,  // [Hv], or [Hv, Dk] with per-key gates
    int first_head,
    int heads,
    const PrepareGradients& grad,
    T* d_mixed);  // [B, T, F]

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
