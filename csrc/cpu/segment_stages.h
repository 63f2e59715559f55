// The stages of the fused layer segment (segment.h) on the CPU, in the
// namespace of the kernels' compiled level (kernel_level.h).
#pragma once

#include "segment/segment_params.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

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

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
