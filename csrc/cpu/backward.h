// CPU kernel of the backward pass (vjp) of the core gated-delta recurrence.
#pragma once

#include "core/core_params.h"

namespace mlx_gated_delta::cpu {

// Where the backward reads and writes; every array is row-contiguous, in the
// layouts of GatedDeltaParams. T is the activation dtype of q, k, v and their
// gradients; gates, states and their gradients are float32.
template <typename T>
struct BackwardBuffers {
  const T* q;
  const T* k;
  const T* v;
  const float* g;  // [B, T, Hv] or [B, T, Hv, Dk] log-space decay
  const float* beta;  // [B, T, Hv]
  const bool* mask;  // [B, T] or nullptr
  const float* state_in;  // [B, Hv, Dv, Dk] initial state
  const T* y_cotangent;  // [B, T, Hv, Dv]
  const float* state_cotangent;  // [B, Hv, Dv, Dk], of the final state
  T* dq;  // [B, T, Hk, Dk], summed over the value heads
  T* dk;
  T* dv;  // [B, T, Hv, Dv]
  float* dg;  // the shape of g
  float* dgamma;  // the shape of g, wrt the linear decay exp(g)
  float* dbeta;  // [B, T, Hv]
  float* dstate;  // [B, Hv, Dv, Dk], of the initial state
};

// The gradients of every input for the cotangents of y and of the final
// state. Keeps one state per chunk of kChunkSize tokens per (batch row, value
// head) in flight, never one per token. `algorithm` (Recurrent or Chunked;
// resolve Auto first) picks the recurrent form's reverse
// (recurrent_backward.cpp) or the chunked WY form's (chunked_backward.cpp,
// with key_chunked_backward.cpp's stages for per-key gates).
template <typename T>
void gated_delta_backward(
    const GatedDeltaParams& params,
    Algorithm algorithm,
    const BackwardBuffers<T>& buffers);

}  // namespace mlx_gated_delta::cpu
