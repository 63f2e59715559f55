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

// The segment's backward on the CPU is two kernels (segment_backward.cpp),
// each a primitive of its own (segment/segment_backward_primitives.h): the
// stages up to the core's gradients, then the prepare stage's backward.

// The segment's backward up to the core's gradients, in one call:
// prepare_conv and prepare_gates recomputed exactly as the forward computes
// them, the core's forward for y, gated_norm_backward, then the core's
// backward. No float32 q, k, v or y is kept beside the gradients: the
// recomputed q, k and v are written where dq, dk and dv go, the core's
// backward overwrites them (BackwardBuffers allows it), and dy overwrites y.
// `forward` and `backward` are the core's algorithms (Recurrent or Chunked;
// resolve Auto first).
template <typename T>
struct SegmentCoreBackwardBuffers {
  const T* mixed_qkvzba;
  const float* conv_weight;
  const float* decay_parameter;
  const float* dt_bias;
  const float* norm_weight;
  const T* conv_state_in;
  const float* state_in;  // [B, Hv, Dv, Dk]
  const bool* mask;  // nullptr when the call has no mask
  const T* d_out;  // [B, T, Hv, Dv], the cotangent of out
  const float* d_state_out;  // [B, Hv, Dv, Dk], of the final state
  // Scratch, float32: y and then dy [B, T, Hv, Dv]; g and dgamma (the
  // shape of g); beta [B, T, Hv]; the final state [B, Hv, Dv, Dk].
  float* y;
  float* g;
  float* beta;
  float* dgamma;
  float* state_out;
  // The gradients, float32: dq, dk [B, T, Hk, Dk], dv [B, T, Hv, Dv], dg (as
  // g), dbeta [B, T, Hv] and dstate [B, Hv, Dv, Dk] of the core; the gated
  // norm's dz [B, T, Hv*Dv] (activation dtype) and d norm_weight per batch
  // row [B, Dv].
  float* dq;
  float* dk;
  float* dv;
  float* dg;
  float* dbeta;
  float* dstate;
  T* dz;
  float* d_norm_weight_rows;
};

template <typename T>
void gated_delta_segment_core_backward(
    const SegmentParams& params,
    Algorithm forward,
    Algorithm backward,
    const SegmentCoreBackwardBuffers<T>& buffers);

// The prepare stage's backward: from the gradients of q, k, v, g, beta, the
// gated norm's dz and the new conv state's cotangent, the gradient of the
// packed row, of the carried conv state, and per batch row of the conv
// weight, the decay parameter and dt_bias.
template <typename T>
struct SegmentPrepareBackwardBuffers {
  const T* mixed_qkvzba;
  const float* conv_weight;
  const float* decay_parameter;
  const float* dt_bias;
  const T* conv_state_in;
  const bool* mask;  // nullptr when the call has no mask
  const float* dq;  // [B, T, Hk, Dk]
  const float* dk;  // [B, T, Hk, Dk]
  const float* dv;  // [B, T, Hv, Dv]
  const float* dg;  // as g
  const float* dbeta;  // [B, T, Hv]
  const T* dz;  // [B, T, Hv*Dv]
  const T* d_conv_state_out;  // [B, K-1, C]
  T* d_mixed_qkvzba;  // [B, T, F]
  T* d_conv_state_in;  // [B, K-1, C]
  float* d_conv_weight_rows;  // [B, C, K]
  float* d_decay_parameter_rows;  // [B, Hv]
  float* d_dt_bias_rows;  // [B, Hv], or [B, Hv*Dk] with per-key gates
};

template <typename T>
void gated_delta_segment_prepare_backward(
    const SegmentParams& params,
    const SegmentPrepareBackwardBuffers<T>& buffers);

}  // namespace mlx_gated_delta::cpu
