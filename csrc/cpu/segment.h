// CPU kernels of the fused layer segment stages around the core recurrence.
//
// The segment runs, per call: prepare_conv (causal depthwise conv over
// q|k|v with the carried conv state, then SiLU) and collect_conv_state,
// prepare_gates (g and beta), the core recurrence (cpu::gated_delta_forward,
// reading q/k/v straight out of the conv output), and gated_norm.
// Every intermediate is float32 whatever the activation dtype T.
#pragma once

#include "segment/segment_params.h"

namespace mlx_gated_delta::cpu {

// qkv[b, t, :] = silu(sum_i window_i * conv_weight[:, i]) over the last K
// unmasked inputs of row b (the carried conv state first), float32 [B, T, C].
// A masked token is skipped: it is not in any window and its qkv row is 0.
template <typename T>
void prepare_conv(
    const SegmentParams& params,
    const T* mixed,  // [B, T, F]
    const float* conv_weight,  // [C, K]
    const T* conv_state,  // [B, K-1, C]
    const bool* mask,  // [B, T] or nullptr
    float* qkv);  // [B, T, C]

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

// g = rate * softplus(a + dt_bias) (log-space decay), beta = sigmoid(b).
template <typename T>
void prepare_gates(
    const SegmentParams& params,
    const T* mixed,  // [B, T, F]
    const float* decay_parameter,  // [Hv]
    const float* dt_bias,  // [Hv]
    float* g,  // [B, T, Hv]
    float* beta);  // [B, T, Hv]

// out = rms_norm(y, eps) * norm_weight * silu(z), per (token, value head);
// masked tokens get 0.
template <typename T>
void gated_norm(
    const SegmentParams& params,
    const float* y,  // [B, T, Hv, Dv]
    const T* mixed,  // [B, T, F] (z is read from here)
    const float* norm_weight,  // [Dv]
    const bool* mask,  // [B, T] or nullptr
    T* out);  // [B, T, Hv, Dv]

// The whole segment: the stages above around cpu::gated_delta_forward.
// `algorithm` must be Recurrent or Chunked (resolve Auto first).
template <typename T>
struct SegmentBuffers {
  const T* mixed_qkvzba;
  const float* conv_weight;
  const float* decay_parameter;
  const float* dt_bias;
  const float* norm_weight;
  const T* conv_state_in;
  const float* state_in;
  const bool* mask;  // nullptr when the call has no mask
  T* out;
  T* conv_state_out;
  float* state_out;
  // params.checkpoint_count positions, and the conv states and states after
  // them; nullptr when N == 0.
  const int* checkpoints = nullptr;
  T* conv_checkpoint_states = nullptr;  // [N, B, K-1, C]
  float* checkpoint_states = nullptr;  // [N, B, Hv, Dv, Dk]
};

template <typename T>
void gated_delta_segment_forward(
    const SegmentParams& params,
    Algorithm algorithm,
    const SegmentBuffers<T>& buffers);

}  // namespace mlx_gated_delta::cpu
