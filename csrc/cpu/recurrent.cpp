// The recurrent form of the gated delta rule on the CPU: token by token.
#include <vector>

#include "cpu/kernel_common.h"

namespace mlx_gated_delta::cpu {

// ---------------------------------------------------------------------------
// Recurrent form: one pass over the state per token. For each state row r the
// decay, the prediction S k, the delta update and the readout S q are fused,
// so the row is read and written once while it sits in L1. The first step
// reads the initial state where it lies and writes the output state, so a
// decode step moves the state exactly once (read + write).
template <typename T>
void recurrent_head(const GatedDeltaParams& p, const HeadView<T>& h) {
  const int dk = p.key_dim, dv = p.value_dim;
  std::vector<float> q(dk), k(dk), v(dv);
  // Per-key gates: the decay of each state column, and k scaled by it (the
  // prediction reads the decayed state: sum_c S_rc exp(g_c) k_c).
  std::vector<float> decays(p.per_key_gates ? dk : 0);
  std::vector<float> decayed_k(p.per_key_gates ? dk : 0);
  if (!h.state_in) {
    copy_initial_state(p, nullptr, h.state);
  }
  const float* source = h.state_in ? h.state_in : h.state;
  for (int t = 0; t < p.tokens; ++t) {
    T* y = h.y + t * h.y_token_stride;
    if (h.mask && !h.mask[t]) {
      zero_output_row(y, dv);
      continue;
    }
    load_qk_vector(h.q + t * h.qk_token_stride, q.data(), dk, p.normalize_qk);
    load_qk_vector(h.k + t * h.qk_token_stride, k.data(), dk, p.normalize_qk);
    load_vector(h.v + t * h.v_token_stride, v.data(), dv);
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
      float* row = h.state + int64_t(r) * dk;
      const float predicted = p.per_key_gates
          ? dot(old_row, decayed_k.data(), dk)
          : decay * dot(old_row, k.data(), dk);
      const float delta = beta * (v[r] - predicted);
      float readout = 0.0f;
      if (p.per_key_gates) {
#pragma omp simd reduction(+ : readout)
        for (int c = 0; c < dk; ++c) {
          const float updated = decays[c] * old_row[c] + delta * k[c];
          row[c] = updated;
          readout += updated * q[c];
        }
      } else {
#pragma omp simd reduction(+ : readout)
        for (int c = 0; c < dk; ++c) {
          const float updated = decay * old_row[c] + delta * k[c];
          row[c] = updated;
          readout += updated * q[c];
        }
      }
      y[r] = T(p.scale * readout);
    }
    source = h.state;
  }
  if (source != h.state) {  // every step was masked
    copy_initial_state(p, source, h.state);
  }
}

template void recurrent_head<float>(
    const GatedDeltaParams&, const HeadView<float>&);
template void recurrent_head<mlx::core::float16_t>(
    const GatedDeltaParams&, const HeadView<mlx::core::float16_t>&);
template void recurrent_head<mlx::core::bfloat16_t>(
    const GatedDeltaParams&, const HeadView<mlx::core::bfloat16_t>&);

}  // namespace mlx_gated_delta::cpu
