// CPU kernel of the fused layer segment: the stages around the core
// recurrence (segment_stages.h) in one call.
//
// The segment runs, per call: prepare_conv (causal depthwise conv over
// q|k|v with the carried conv state, then SiLU) and collect_conv_state,
// prepare_gates (g and beta), the core recurrence (cpu::gated_delta_forward,
// reading q/k/v straight out of the conv output), and gated_norm.
// Every intermediate is float32 whatever the activation dtype T.
#pragma once

#include <cstdint>

#include "segment/segment_params.h"

namespace mlx_gated_delta::cpu {

// The whole segment: the stages of segment_stages.h around
// cpu::gated_delta_forward, in waves of key heads with the value heads that
// read them (segment_wave_key_heads), so that the float32 q, k, v and y are
// one wave's.
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

// The segment's backward on the CPU, in one call (segment_backward.cpp; the
// primitive segment/segment_backward_primitives.h): prepare_conv and
// prepare_gates recomputed exactly as the forward computes them, the core's
// forward for y, gated_norm_backward, the core's backward, then
// prepare_conv_backward and prepare_gates_backward. They run in waves of
// `wave_key_heads` key heads (segment_wave_key_heads) with the value
// heads that read them, all stages of one wave before the next, so that the
// float32 q, k, v and y are one wave's, not every head's. No float32 q, k, v
// or y is kept beside the gradients either: the recomputed q, k and v are
// written where dq, dk and dv go, the core's backward overwrites them
// (BackwardBuffers allows it), dy overwrites y, and dz goes straight to the z
// columns of the packed row's gradient. `forward` and `backward` are the
// core's algorithms (Recurrent or Chunked; resolve Auto first).
template <typename T>
struct SegmentBackwardBuffers {
  const T* mixed_qkvzba;
  const float* conv_weight;
  const float* decay_parameter;
  const float* dt_bias;
  const float* norm_weight;
  const T* conv_state_in;
  const float* state_in;  // [B, Hv, Dv, Dk]
  const bool* mask;  // nullptr when the call has no mask
  const T* d_out;  // [B, T, Hv, Dv], the cotangent of out
  const T* d_conv_state_out;  // [B, K-1, C], of the new conv state
  const float* d_state_out;  // [B, Hv, Dv, Dk], of the final state
  int wave_key_heads;
  // Scratch, float32, of one wave of Hk' key heads and the Hv' value heads
  // that read them: y and then dy [B, T, Hv', Dv]; g, dg and dgamma (the
  // shape of g: [B, T, Hv'], or [B, T, Hv', Dk] with per-key gates); beta
  // and dbeta [B, T, Hv']; the wave's states [B, Hv', Dv, Dk]: initial,
  // final, the final one's cotangent and the initial one's gradient; q and
  // then dq, k and then dk [B, T, Hk', Dk], v and then dv [B, T, Hv', Dv].
  float* y;
  float* g;
  float* dg;
  float* dgamma;
  float* beta;
  float* dbeta;
  float* wave_state_in;
  float* state_out;
  float* wave_d_state_out;
  float* wave_dstate;
  float* dq;
  float* dk;
  float* dv;
  // The gradients.
  T* d_mixed_qkvzba;  // [B, T, F]
  T* d_conv_state_in;  // [B, K-1, C]
  float* d_conv_weight_rows;  // [B, C, K]
  float* d_decay_parameter_rows;  // [B, Hv]
  float* d_dt_bias_rows;  // [B, Hv], or [B, Hv*Dk] with per-key gates
  float* d_norm_weight_rows;  // [B, Dv]
  float* dstate;  // [B, Hv, Dv, Dk], of the initial state
};

// The key heads of one wave of the segment's forward and backward (they run
// their stages for those key heads and the value heads that read them, wave
// after wave): every key head with the interleaved mapping; with the grouped
// mapping (a key head's value heads are consecutive), as many as keep the
// wave's float32 q, k, v and y within the wave budget (kSegmentWaveBytes),
// and at least enough for one (batch row, key head) pair per thread, split
// evenly: with fewer, the core would run each value head as a task of its
// own and repeat its key head's work for each (cpu_value_heads_per_task). A
// short call (a decode step) is one wave, and a long one does not pay each
// wave's stage calls and waits more often than it must. Compiled once
// (segment_waves.cpp), not per kernel level: the budget is one value.
constexpr int64_t kSegmentWaveBytes = int64_t(32) << 20;

int segment_wave_key_heads(const SegmentParams& p, int threads);

// Testing only: sets the wave budget (bytes) and returns the one before, so
// that a test runs a small call in several waves (test_hooks.cpp).
int64_t exchange_segment_wave_bytes(int64_t bytes);

template <typename T>
void gated_delta_segment_backward(
    const SegmentParams& params,
    Algorithm forward,
    Algorithm backward,
    const SegmentBackwardBuffers<T>& buffers);

}  // namespace mlx_gated_delta::cpu
