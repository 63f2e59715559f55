// CPU kernel of the fused layer segment: the stages around the core
// recurrence (segment_stages.h) in one call.
//
// The segment runs, per call: prepare_conv (causal depthwise conv over
// q|k|v with the carried conv state, then SiLU) and collect_conv_state,
// prepare_gates (g and beta), the core recurrence (cpu::gated_delta_forward,
// reading q/k/v straight out of the conv output), and gated_norm.
// Every intermediate is float32 whatever the activation dtype T.
#pragma once

#include "segment/segment_params.h"

namespace mlx_gated_delta::cpu {

// The whole segment: the stages of segment_stages.h around
// cpu::gated_delta_forward.
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
