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

// The segment's backward on the CPU is the core's backward between the
// backward of the stages after it and of those before it; these are the
// stages' parts (segment_backward.cpp), each a primitive of its own
// (segment/segment_backward_primitives.h).

// The prepare stage alone (prepare_conv, prepare_gates), recomputed for the
// backward: q, k, v, g and beta exactly as the forward computes them, with
// q, k and v as arrays of their own.
template <typename T>
struct SegmentPrepareBuffers {
  const T* mixed_qkvzba;
  const float* conv_weight;
  const float* decay_parameter;
  const float* dt_bias;
  const T* conv_state_in;
  const bool* mask;  // nullptr when the call has no mask
  float* q;  // [B, T, Hk, Dk]
  float* k;  // [B, T, Hk, Dk]
  float* v;  // [B, T, Hv, Dv]
  float* g;  // [B, T, Hv], or [B, T, Hv, Dk] with per-key gates
  float* beta;  // [B, T, Hv]
};

template <typename T>
void gated_delta_segment_prepare(
    const SegmentParams& params, const SegmentPrepareBuffers<T>& buffers);

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

// The gated norm's backward.
template <typename T>
struct SegmentNormBackwardBuffers {
  const float* y;  // [B, T, Hv, Dv], the core's output
  const T* mixed_qkvzba;  // z is read from here
  const float* norm_weight;  // [Dv]
  const T* d_out;  // [B, T, Hv, Dv]
  const bool* mask;  // nullptr when the call has no mask
  float* d_y;  // [B, T, Hv, Dv]
  T* d_z;  // [B, T, Hv*Dv]
  float* d_norm_weight_rows;  // [B, Dv]
};

template <typename T>
void gated_delta_segment_norm_backward(
    const SegmentParams& params, const SegmentNormBackwardBuffers<T>& buffers);

}  // namespace mlx_gated_delta::cpu
