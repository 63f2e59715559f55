// The pieces of the CPU backward shared by its two forms
// (recurrent_backward.cpp, the recurrent form; chunked_backward.cpp, the
// chunked WY form).
#pragma once

#include <cstdint>

#include "core/core_params.h"
#include "cpu/backward.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

// The backward's view of one (batch row, value head) problem: the addresses
// of its token 0, the forward's inputs (as HeadView, kernel_common.h, holds
// them for the forward) with the cotangents and the gradients.
template <typename T>
struct BackwardHeadView {
  const T* q;
  const T* k;
  const T* v;
  const T* dy;
  int64_t qk_token_stride;
  int64_t v_token_stride;
  const float* g;  // and dg, dgamma: [T, Hv] or, per key, [T, Hv, Dk]-strided
  int64_t g_token_stride;
  const float* beta;
  const bool* mask;
  int64_t gate_token_stride;  // of beta and dbeta
  const float* state_in;
  const float* state_cotangent;
  float* dq_head;  // float32 scratch of this problem alone, [T, Dk]
  float* dk_head;
  int64_t head_grad_token_stride;  // Dk
  T* dv;
  float* dg;
  float* dgamma;
  float* dbeta;
  float* dstate;
};

// Problem (batch, head) of `b`, its per-value-head dq and dk in the float32
// scratch `dq_head` and `dk_head` ([T, Dk] each, this problem's alone).
template <typename T>
BackwardHeadView<T> backward_head_view(
    const GatedDeltaParams& p,
    const BackwardBuffers<T>& b,
    int batch,
    int head,
    float* dq_head,
    float* dk_head) {
  const int dk = p.key_dim, dv = p.value_dim, width = p.gate_width();
  const int key_head = p.key_head_of(head);
  const int64_t qk_offset =
      int64_t(batch) * p.tokens * p.key_heads * dk + int64_t(key_head) * dk;
  const int64_t v_offset =
      (int64_t(batch) * p.tokens * p.value_heads + head) * dv;
  const int64_t gate_offset = int64_t(batch) * p.tokens * p.value_heads + head;
  const int64_t state_offset =
      (int64_t(batch) * p.value_heads + head) * dv * dk;
  return BackwardHeadView<T>{
      b.q + qk_offset,
      b.k + qk_offset,
      b.v + v_offset,
      b.y_cotangent + v_offset,
      int64_t(p.key_heads) * dk,
      int64_t(p.value_heads) * dv,
      b.g + gate_offset * width,
      int64_t(p.value_heads) * width,
      b.beta + gate_offset,
      b.mask ? b.mask + int64_t(batch) * p.tokens : nullptr,
      p.value_heads,
      b.state_in + state_offset,
      b.state_cotangent + state_offset,
      dq_head,
      dk_head,
      dk,
      b.dv + v_offset,
      b.dg + gate_offset * width,
      b.dgamma + gate_offset * width,
      b.dbeta + gate_offset,
      b.dstate + state_offset,
  };
}

// The chunked backward of one problem (chunked_backward.cpp): writes every
// gradient of its tokens and its dstate, as recurrent_head_backward does;
// with a trace, each stage's output too.
template <typename T>
void chunked_head_backward(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    ChunkedBackwardTrace* trace = nullptr);

// The recurrent form's reverse of the tokens [start, start + length) of one
// problem, from the state entering them (`entry`, [Dv, Dk]); `ds` holds the
// cotangent of the state after them on entry and before them on return. The
// chunked backward runs a chunk this way when one of its decays is not a
// normal float (a wipe), where its gate gradient would divide by the decay.
template <typename T>
void recurrent_chunk_backward_from_entry(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    int start,
    int length,
    const float* entry,
    float* ds);

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
