// The chunked WY form's backward on the CPU with scalar gates (ScalarGates,
// one decay per row), and its entry point for both gate kinds: the stages
// are chunked_backward_stages.h's, written over the decay kind, and the
// per-key gates' kind is key_chunked_backward.cpp's.
#include <algorithm>
#include <vector>

#include "cpu/chunked_backward_stages.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

namespace chunked_backward {

// The share of V' = U - W S0^T in chunk_carry_backward: dW = -dV' S0 and
// dS0 -= W^T dV' (transposed, into b.ds0_t).
void delta_backward(const GatedDeltaParams& p, int L, BackwardScratch& b) {
  const int dk = p.key_dim, dv = p.value_dim;
  fill_zero(b.dw);
  gemm(
      L,
      dk,
      dv,
      -1.0f,
      {b.d_corrected.data(), dv, 1},
      b.entry.data(),
      dk,
      b.dw.data(),
      dk);
  gemm(
      dk,
      dv,
      L,
      -1.0f,
      {b.w, 1, dk},
      b.d_corrected.data(),
      dv,
      b.ds0_t.data(),
      dv);
}

// recompute_w_u_backward's products, from Vb^T and Kb^T (b.scaled_v_t,
// b.scaled_k_t): dT = dU Vb^T + dW Kb^T (lower), dVb = T^T dU, dKb = T^T dW.
void w_u_products(const GatedDeltaParams& p, int L, BackwardScratch& b) {
  const int dk = p.key_dim, dv = p.value_dim;
  fill_zero(b.dt);
  gemm(
      L,
      L,
      dv,
      1.0f,
      {b.d_corrected.data(), dv, 1},
      b.scaled_v_t.data(),
      C,
      b.dt.data(),
      C,
      Triangle::LowerC);
  gemm(
      L,
      L,
      dk,
      1.0f,
      {b.dw.data(), dk, 1},
      b.scaled_k_t.data(),
      C,
      b.dt.data(),
      C,
      Triangle::LowerC);
  for (int i = 0; i < L; ++i) {  // T is lower: its gradient is too
    std::fill(&b.dt[i * C + i + 1], &b.dt[i * C + C], 0.0f);
  }
  const MatrixA inverse_t{b.inverse, 1, C};
  fill_zero(b.d_scaled_v);
  gemm(
      L,
      dv,
      L,
      1.0f,
      inverse_t,
      b.d_corrected.data(),
      dv,
      b.d_scaled_v.data(),
      dv,
      Triangle::UpperA);
  fill_zero(b.d_scaled_k);
  gemm(
      L,
      dk,
      L,
      1.0f,
      inverse_t,
      b.dw.data(),
      dk,
      b.d_scaled_k.data(),
      dk,
      Triangle::UpperA);
}

// kkt_inverse_backward's dA = -T^T dT T^T (lower part valid) into b.da.
void inverse_gradient(int L, BackwardScratch& b) {
  transpose(b.inverse, L, L, C, b.inverse_t.data(), C);
  fill_zero(b.x);
  gemm(
      L,
      L,
      L,
      1.0f,
      {b.dt.data(), C, 1},
      b.inverse_t.data(),
      C,
      b.x.data(),
      C,
      Triangle::LowerA);
  fill_zero(b.da);
  gemm(
      L,
      L,
      L,
      -1.0f,
      {b.inverse, 1, C},
      b.x.data(),
      C,
      b.da.data(),
      C,
      Triangle::UpperA);
}

}  // namespace chunked_backward

namespace {

using namespace chunked_backward;

// Scalar gates: the row and column products of a lower [L, L] matrix X
// already decayed, rows += X B and columns += X^T A ([L, Dk] rows).
void row_column_products(
    int L,
    int dk,
    const float* x,
    const float* a,
    const float* b,
    float* rows,
    float* columns) {
  gemm(L, dk, L, 1.0f, {x, C, 1}, b, dk, rows, dk, Triangle::LowerA);
  gemm(L, dk, L, 1.0f, {x, 1, C}, a, dk, columns, dk, Triangle::UpperA);
}

// Adds c to dG_i and -c to dG_j for every term c_ij = dX_ij X_ij (j < i) of
// a decayed [L, L] matrix X (X_ij = decay(i, j) times the rest); on the
// diagonal the two would cancel.
void decayed_matrix_gate_terms(
    const float* d_matrix, const float* matrix, int L, float* d_log) {
  for (int i = 0; i < L; ++i) {
    float row_sum = 0.0f;
    for (int j = 0; j < i; ++j) {
      const float c = d_matrix[i * C + j] * matrix[i * C + j];
      row_sum += c;
      d_log[j] -= c;
    }
    d_log[i] += row_sum;
  }
}

// Scalar gates: one decay per row (the notation of chunked_backward_stages.h).
struct ScalarGates {
  // One factor per row: the same for every channel.
  struct RowFactor {
    float value;
    float operator[](int) const {
      return value;
    }
  };
  static RowFactor from_start(const ChunkScratch& s, int i, int /*dk*/) {
    return {s.decays.from_start(i)};
  }
  static RowFactor to_end(const ChunkScratch& s, int j, int /*dk*/) {
    return {s.decays.to_end(j)};
  }

  static void forward_grams(
      int dk, int L, ChunkScratch& s, ChunkStore& /*store*/, int /*chunk*/) {
    k_gram(dk, L, s);
  }

  static void reverse_grams(
      int dk,
      int L,
      BackwardScratch& b,
      const ChunkStore& /*store*/,
      int /*chunk*/) {
    transpose(b.s.k.data(), L, dk, dk, b.s.k_transposed.data(), C);
    chunk_qk(dk, L, b.s);
  }

  static const float* output_matrix(int L, BackwardScratch& b) {
    const ChunkScratch& s = b.s;
    for (int i = 0; i < L; ++i) {
      for (int j = 0; j < L; ++j) {
        b.m[i * C + j] = j <= i ? s.decay[i * C + j] * s.qk[i * C + j] : 0.0f;
      }
    }
    return b.m.data();
  }

  // dMd = dM o decay, dq = dMd K, dk = dMd^T Q; M's decay terms dM_ij M_ij.
  static void output_products(
      const GatedDeltaParams& p, int L, BackwardScratch& b) {
    const ChunkScratch& s = b.s;
    decayed_matrix_gate_terms(b.dm.data(), b.m.data(), L, b.d_log.data());
    for (int i = 0; i < L; ++i) {
      for (int j = 0; j < L; ++j) {
        // The decay matrix is 0 above the diagonal, where LowerC may have
        // left partial sums.
        b.dm[i * C + j] *= s.decay[i * C + j];
      }
    }
    fill_zero(b.dq);
    fill_zero(b.dk);
    row_column_products(
        L,
        p.key_dim,
        b.dm.data(),
        s.q.data(),
        s.k.data(),
        b.dq.data(),
        b.dk.data());
  }

  // With P = dO S0: dq_i += Gamma_i P_i and the decay term Gamma_i P_i . q_i;
  // dS0 = Gamma_{L-1} dS + Q^T diag(Gamma) dO, whose chunk decay gains
  // <dS, S0>.
  static EntryOperands entry_backward(
      const GatedDeltaParams& p,
      int L,
      BackwardScratch& b,
      const float* entry_t) {
    const int dk = p.key_dim, dv = p.value_dim;
    const ChunkScratch& s = b.s;
    for (int i = 0; i < L; ++i) {
      const float decay_from_start = s.decays.from_start(i);
      const float* out_state = &b.out_state[i * dk];
      b.d_log[i] += decay_from_start * dot(out_state, &s.q[i * dk], dk);
      axpy(decay_from_start, out_state, &b.dq[i * dk], dk);
      for (int c = 0; c < dv; ++c) {
        b.scaled_d_out[i * dv + c] = decay_from_start * b.d_out[i * dv + c];
      }
    }
    const float chunk_decay = s.decays.from_start(L - 1);
    float entry_term = 0.0f;
    for (int64_t e = 0; e < int64_t(dk) * dv; ++e) {
      b.ds0_t[e] = chunk_decay * b.ds_t[e];
      entry_term += b.ds_t[e] * entry_t[e];
    }
    b.d_log[L - 1] += chunk_decay * entry_term;
    return {s.q.data(), b.scaled_d_out.data()};
  }

  // dk_j += e_j (V' dS)_j, and its decay term at L - 1 and j.
  static void exit_backward(
      const GatedDeltaParams& p, int L, BackwardScratch& b) {
    const int dk = p.key_dim;
    const ChunkScratch& s = b.s;
    for (int j = 0; j < L; ++j) {
      const float e = s.decays.to_end(j);
      float term = 0.0f;
      for (int c = 0; c < dk; ++c) {
        const float d = e * b.row_tmp[j * dk + c];
        b.dk[j * dk + c] += d;
        term += d * s.k[j * dk + c];
      }
      b.d_log[L - 1] += term;
      b.d_log[j] -= term;
    }
  }

  // Kb_i = beta_i Gamma_i k_i: dk_i += beta_i Gamma_i dKb_i, and dbeta_i and
  // the decay term gain Gamma_i dKb_i . k_i (the latter times beta_i).
  static float scaled_key_backward(
      const GatedDeltaParams& p, int i, BackwardScratch& b) {
    const int dk = p.key_dim;
    const ChunkScratch& s = b.s;
    const float decay_from_start = s.decays.from_start(i);
    const float w_scale = s.beta[i] * decay_from_start;
    const float* d_scaled_k = &b.d_scaled_k[i * dk];
    const float k_term = dot(d_scaled_k, &s.k[i * dk], dk);
    axpy(w_scale, d_scaled_k, &b.dk[i * dk], dk);
    b.d_log[i] += w_scale * k_term;
    return decay_from_start * k_term;
  }

  // With dAk = dA o beta_i decay(i, j): dk += dAk K + dAk^T K, and A's shares
  // of dbeta and the gate.
  static void inverse_backward(
      const GatedDeltaParams& p, int L, BackwardScratch& b) {
    const ChunkScratch& s = b.s;
    // A's terms: with t_ij = dA_ij decay(i, j) k_i.k_j, dbeta_i gains t_ij
    // and the decay term is dA_ij A_ij = beta_i t_ij.
    for (int i = 0; i < L; ++i) {
      float dbeta = 0.0f;
      for (int j = 0; j < L; ++j) {
        if (j >= i) {
          b.da[i * C + j] = 0.0f;
          continue;
        }
        const float decayed = s.decay[i * C + j] * b.da[i * C + j];
        const float term = decayed * b.k_gram[i * C + j];
        dbeta += term;
        b.d_log[j] -= s.beta[i] * term;
        b.da[i * C + j] = s.beta[i] * decayed;
      }
      b.dbeta[i] += dbeta;
      b.d_log[i] += s.beta[i] * dbeta;
    }
    row_column_products(
        L,
        p.key_dim,
        b.da.data(),
        s.k.data(),
        s.k.data(),
        b.dk.data(),
        b.dk.data());
  }
};

}  // namespace

template <typename T>
void chunked_head_backward(
    const GatedDeltaParams& p, const BackwardHeadView<T>& h) {
  if (p.per_key_gates) {
    key_chunked_head_backward(p, h);
  } else {
    chunked_backward::head_backward<ScalarGates>(p, h);
  }
}

template void chunked_head_backward<float>(
    const GatedDeltaParams&, const BackwardHeadView<float>&);
template void chunked_head_backward<mlx::core::float16_t>(
    const GatedDeltaParams&, const BackwardHeadView<mlx::core::float16_t>&);
template void chunked_head_backward<mlx::core::bfloat16_t>(
    const GatedDeltaParams&, const BackwardHeadView<mlx::core::bfloat16_t>&);

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
