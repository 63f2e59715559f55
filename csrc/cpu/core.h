// CPU kernels of the core gated-delta recurrence (docs/contract.md).
#pragma once

#include <cstdint>

#include "core/core_params.h"

namespace mlx_gated_delta::cpu {

// Where the kernel reads and writes. q, k, v and y are addressed by
// (batch, token, head) through explicit strides in elements, so a caller can
// point q/k/v into a packed per-token buffer (the fused segment does) without
// a copy; the innermost (head dim) stride is always 1.
template <typename T>
struct CoreBuffers {
  const T* q;
  const T* k;
  const T* v;
  int64_t qk_batch_stride;  // between batch rows of q and of k
  int64_t qk_token_stride;  // between tokens of q and of k
  int64_t v_batch_stride;
  int64_t v_token_stride;
  const float* g;  // [B, T, Hv] or [B, T, Hv, Dk], log-space decay
  const float* beta;  // [B, T, Hv]
  const bool* mask;  // [B, T] or nullptr
  const float* state_in;  // [B, Hv, Dv, Dk] or nullptr for zeros
  T* y;  // [B, T, Hv, Dv], contiguous
  float* state_out;  // [B, Hv, Dv, Dk]; may alias nothing it reads
  // params.checkpoint_count positions (strictly increasing, in [1, T]) and
  // the states after them, [N, B, Hv, Dv, Dk]; nullptr when N == 0.
  const int* checkpoints = nullptr;
  float* checkpoint_states = nullptr;
  // Tree verification: [T] parent of each token (params.has_tree), else
  // nullptr.
  const int* parents = nullptr;
};

// The buffers of one core call in the op's own contiguous layouts.
template <typename T>
CoreBuffers<T> contiguous_buffers(
    const GatedDeltaParams& p,
    const T* q,
    const T* k,
    const T* v,
    const float* g,
    const float* beta,
    const bool* mask,
    const float* state_in,
    T* y,
    float* state_out,
    const int* checkpoints = nullptr,
    float* checkpoint_states = nullptr,
    const int* parents = nullptr) {
  return CoreBuffers<T>{
      q,
      k,
      v,
      int64_t(p.tokens) * p.key_heads * p.key_dim,
      int64_t(p.key_heads) * p.key_dim,
      int64_t(p.tokens) * p.value_heads * p.value_dim,
      int64_t(p.value_heads) * p.value_dim,
      g,
      beta,
      mask,
      state_in,
      y,
      state_out,
      checkpoints,
      checkpoint_states,
      parents};
}

// Runs the whole recurrence for every (batch row, value head), threaded over
// those pairs. `algorithm` must be Recurrent or Chunked (resolve Auto first).
template <typename T>
void gated_delta_forward(
    const GatedDeltaParams& params,
    Algorithm algorithm,
    const CoreBuffers<T>& buffers);

}  // namespace mlx_gated_delta::cpu
