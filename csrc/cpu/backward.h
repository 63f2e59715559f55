// CPU kernel of the backward pass (vjp) of the core gated-delta recurrence.
#pragma once

#include <vector>

#include "core/core_params.h"

namespace mlx_gated_delta::cpu {

// Where the backward reads and writes; every array is row-contiguous, in the
// layouts of GatedDeltaParams. T is the activation dtype of q, k, v and their
// gradients; gates, states and their gradients are float32.
//
// dq, dk and dv may be q, k and v themselves (the segment's backward writes
// its recomputed q, k, v where their gradients go, segment.h): every
// problem reads its value head's rows of v before it writes their dv (each
// chunk's, last chunk first, after boundary_states has read them all), and
// dq, dk of a key head are written by qk_grad_reduce, each row after it has
// read that row of q or k, once every problem that reads them is done (the
// problems run in waves of whole key-head groups). No other output may
// alias an input.
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

// What the chunked backward's stages leave, chunk by chunk, for one problem
// (chunked_backward_stages.h), so that the tests hold each stage to its
// float64 reference (docs/stages.md). Each chunk's slot is kChunkSize rows
// ([C, L, width]); rows past a short last chunk are 0, and so is every slot
// of a chunk that runs the recurrent reverse. dq and dk are this value
// head's, before qk_grad_reduce, as they stand after each stage that adds
// to them; dbeta likewise.
struct ChunkedBackwardTrace {
  int chunks = 0;
  // chunk_output_backward: dV' = M^T dO [C, L, Dv], dq, dk [C, L, Dk].
  std::vector<float> output_d_corrected, output_dq, output_dk;
  // chunk_carry_backward: dV' (= dU) [C, L, Dv], dW, dq, dk [C, L, Dk].
  std::vector<float> carry_d_corrected, carry_dw, carry_dq, carry_dk;
  // recompute_w_u_backward: dT [C, L, L], dk [C, L, Dk], dbeta [C, L].
  std::vector<float> w_u_dt, w_u_dk, w_u_dbeta;
  // kkt_inverse_backward: dk [C, L, Dk], dbeta [C, L].
  std::vector<float> kkt_dk, kkt_dbeta;
  // gate_cumsum_backward: dg, [C, L] (per key channel [C, L, Dk]).
  std::vector<float> dg;
};

// Testing only: the chunked backward in float32 on problem (batch, head)
// of `buffers` alone, writing its dv, dg, dgamma, dbeta and dstate there as
// the kernel does (its dq and dk are the trace's), and the trace of its
// stages.
ChunkedBackwardTrace trace_chunked_backward_stages(
    const GatedDeltaParams& params,
    const BackwardBuffers<float>& buffers,
    int batch,
    int head);

}  // namespace mlx_gated_delta::cpu
