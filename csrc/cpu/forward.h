// CPU kernels of the core gated-delta recurrence (docs/contract.md).
#pragma once

#include <cstdint>
#include <vector>

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

// Testing only: every stage's output of the chunked form for one problem,
// chunk by chunk, as the pipeline leaves it in its scratch, so that a test
// compares each stage with its namesake in the float64 reference
// (docs/stages.md) and a wrong stage fails under its own name. Each chunk's
// slot is kChunkSize rows (tiles kChunkSize x kChunkSize); rows past a short
// last chunk are 0, and so is what a stage leaves undefined above a tile's
// diagonal.
// With per-key gates, gate_cumsum's log_cumsum and last_wipe are [C, L, Dk],
// and k_gram and qk hold key_decayed_grams' decayed tiles.
struct ChunkedTrace {
  int chunks = 0;
  std::vector<float> q, k;  // qk_norm: [C, L, Dk]
  std::vector<float> log_cumsum, beta;  // gate_cumsum: [C, L]
  std::vector<int> last_wipe;  // gate_cumsum: [C, L]
  std::vector<float> k_gram, qk;  // k_gram, chunk_qk: [C, L, L]
  std::vector<float> inverse;  // kkt_inverse: [C, L, L]
  std::vector<float> w, u;  // recompute_w_u: [C, L, Dk], [C, L, Dv]
  std::vector<float> corrected, output_inter;  // chunk_carry: [C, L, Dv]
  std::vector<float> state;  // chunk_carry_state: exit states, [C, Dv, Dk]
};

// Testing only: runs the float32 chunked form (no checkpoints)
// on problem (batch, head) of `buffers` alone, writing its y rows and final
// state there as the kernel does, and returns the trace of its stages.
ChunkedTrace trace_chunked_stages(
    const GatedDeltaParams& params,
    const CoreBuffers<float>& buffers,
    int batch,
    int head);

}  // namespace mlx_gated_delta::cpu
