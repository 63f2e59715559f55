// The recurrent form of the gated delta rule on the CPU: token by token.
#include <vector>

#include "cpu/kernel_common.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

// ---------------------------------------------------------------------------
// Recurrent form: one pass over the state per token. For each state row r the
// decay, the prediction S k, the delta update and the readout S q are fused,
// so the row is read and written once while it sits in L1. The first step
// reads the initial state where it lies and writes the output state, so a
// decode step moves the state exactly once (read + write).
// One token's step: from the state at `source` to the state at `destination`
// (they may be the same buffer), writing the token's output row. q, k, v and,
// with per-key gates, decays and decayed_k are the caller's scratch (Dk, Dk,
// Dv, Dk, Dk floats).
template <typename T>
void recurrent_step(
    const GatedDeltaParams& p,
    const HeadView<T>& h,
    int t,
    const float* source,
    float* destination,
    float* q,
    float* k,
    float* v,
    float* decays,
    float* decayed_k) {
  const int dk = p.key_dim, dv = p.value_dim;
  T* y = h.y + t * h.y_token_stride;
  load_qk_vector(h.q + t * h.qk_token_stride, q, dk, p.normalize_qk);
  load_qk_vector(h.k + t * h.qk_token_stride, k, dk, p.normalize_qk);
  load_vector(h.v + t * h.v_token_stride, v, dv);
  const float* g = h.g + t * h.g_token_stride;
  const float beta = h.beta[t * h.gate_token_stride];
  if (p.per_key_gates) {
    for (int c = 0; c < dk; ++c) {
      decays[c] = std::exp(g[c]);  // g = -inf: exactly 0, a wipe of column c
      decayed_k[c] = decays[c] * k[c];
    }
  }
  const float decay = p.per_key_gates ? 0.0f : std::exp(g[0]);
  for (int r = 0; r < dv; ++r) {
    const float* old_row = source + int64_t(r) * dk;
    float* row = destination + int64_t(r) * dk;
    const float predicted = p.per_key_gates ? dot(old_row, decayed_k, dk)
                                            : decay * dot(old_row, k, dk);
    const float delta = beta * (v[r] - predicted);
    if (p.per_key_gates) {
      for (int c = 0; c < dk; ++c) {
        row[c] = decays[c] * old_row[c] + delta * k[c];
      }
    } else {
      for (int c = 0; c < dk; ++c) {
        row[c] = decay * old_row[c] + delta * k[c];
      }
    }
    y[r] = T(p.scale * dot(row, q, dk));
  }
}

// Tree verification: token t steps from its parent's state (the initial
// state for -1), so every token's state is kept until the call ends. The
// final state is the last token's.
template <typename T>
void tree_head(const GatedDeltaParams& p, const HeadView<T>& h) {
  const int dk = p.key_dim, dv = p.value_dim;
  const int64_t state_size = int64_t(dv) * dk;
  std::vector<float> q(dk), k(dk), v(dv);
  std::vector<float> decays(p.per_key_gates ? dk : 0);
  std::vector<float> decayed_k(p.per_key_gates ? dk : 0);
  std::vector<float> initial(state_size), nodes(p.tokens * state_size);
  copy_state(p, h.state_in, initial.data());
  int next_checkpoint = 0;
  for (int t = 0; t < p.tokens; ++t) {
    const float* source =
        h.parents[t] < 0 ? initial.data() : &nodes[h.parents[t] * state_size];
    float* node = &nodes[t * state_size];
    if (h.mask && !h.mask[t]) {
      zero_output_row(h.y + t * h.y_token_stride, dv);
      copy_state(p, source, node);
    } else {
      recurrent_step(
          p,
          h,
          t,
          source,
          node,
          q.data(),
          k.data(),
          v.data(),
          decays.data(),
          decayed_k.data());
    }
    if (next_checkpoint < h.checkpoint_count &&
        h.checkpoints[next_checkpoint] == t + 1) {
      copy_state(p, node, checkpoint_slot(h, next_checkpoint));
      ++next_checkpoint;
    }
  }
  copy_state(p, &nodes[(p.tokens - 1) * state_size], h.state);
}

template <typename T>
void recurrent_head(const GatedDeltaParams& p, const HeadView<T>& h) {
  if (h.parents) {
    tree_head(p, h);
    return;
  }
  const int dk = p.key_dim, dv = p.value_dim;
  std::vector<float> q(dk), k(dk), v(dv);
  // Per-key gates: the decay of each state column, and k scaled by it (the
  // prediction reads the decayed state: sum_c S_rc exp(g_c) k_c).
  std::vector<float> decays(p.per_key_gates ? dk : 0);
  std::vector<float> decayed_k(p.per_key_gates ? dk : 0);
  if (!h.state_in) {
    copy_state(p, nullptr, h.state);
  }
  const float* source = h.state_in ? h.state_in : h.state;
  int next_checkpoint = 0;
  for (int t = 0; t < p.tokens; ++t) {
    if (h.mask && !h.mask[t]) {
      zero_output_row(h.y + t * h.y_token_stride, dv);
    } else {
      recurrent_step(
          p,
          h,
          t,
          source,
          h.state,
          q.data(),
          k.data(),
          v.data(),
          decays.data(),
          decayed_k.data());
      source = h.state;
    }
    // A checkpoint is a copy of the state after its token, masked or not.
    if (next_checkpoint < h.checkpoint_count &&
        h.checkpoints[next_checkpoint] == t + 1) {
      copy_state(p, source, checkpoint_slot(h, next_checkpoint));
      ++next_checkpoint;
    }
  }
  if (source != h.state) {  // every step was masked
    copy_state(p, source, h.state);
  }
}

template void recurrent_head<float>(
    const GatedDeltaParams&, const HeadView<float>&);
template void recurrent_head<mlx::core::float16_t>(
    const GatedDeltaParams&, const HeadView<mlx::core::float16_t>&);
template void recurrent_head<mlx::core::bfloat16_t>(
    const GatedDeltaParams&, const HeadView<mlx::core::bfloat16_t>&);

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
