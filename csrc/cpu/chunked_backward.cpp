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
  gemm(
      L,
      dk,
      dv,
      -1.0f,
      {b.d_corrected.data(), dv, 1},
      b.entry.data(),
      dk,
      b.dw.data(),
      dk,
      Triangle::None,
      Output::Overwrite);
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
      Triangle::UpperA,
      Output::Overwrite);
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
      Triangle::UpperA,
      Output::Overwrite);
}

// kkt_inverse_backward's dA = -T^T dT T^T (lower part valid) into b.da.
void inverse_gradient(int L, BackwardScratch& b) {
  transpose(b.inverse, L, L, C, b.inverse_t.data(), C);
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
      Triangle::LowerA,
      Output::Overwrite);
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
      Triangle::UpperA,
      Output::Overwrite);
}

}  // namespace chunked_backward

namespace {

using namespace chunked_backward;

// Scalar gates: the row and column products of a lower [L, L] matrix X
// already decayed, rows += X B and columns += X^T A ([L, Dk] rows); with
// Output::Overwrite rows = X B and columns = X^T A.
void row_column_products(
    int L,
    int dk,
    const float* x,
    const float* a,
    const float* b,
    float* rows,
    float* columns,
    Output output) {
  gemm(L, dk, L, 1.0f, {x, C, 1}, b, dk, rows, dk, Triangle::LowerA, output);
  gemm(L, dk, L, 1.0f, {x, 1, C}, a, dk, columns, dk, Triangle::UpperA, output);
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

  // dMd = dM o decay (into b.m, read), dq = dMd K, dk = dMd^T Q.
  static void output_products(
      const GatedDeltaParams& p, int L, BackwardScratch& b) {
    const ChunkScratch& s = b.s;
    for (int i = 0; i < L; ++i) {
      for (int j = 0; j < L; ++j) {
        // The decay matrix is 0 above the diagonal, where LowerC may have
        // left partial sums.
        b.m[i * C + j] = b.dm[i * C + j] * s.decay[i * C + j];
      }
    }
    row_column_products(
        L,
        p.key_dim,
        b.m.data(),
        s.q.data(),
        s.k.data(),
        b.dq.data(),
        b.dk.data(),
        Output::Overwrite);
  }

  // With P = dO S0: dq_i += Gamma_i P_i, and Gamma_i's gradient gains
  // P_i . q_i; dS0 = Gamma_{L-1} dS + Q^T diag(Gamma) dO, and Gamma_{L-1}'s
  // gradient gains <dS, S0>.
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
      b.entry_terms[i] += dot(out_state, &s.q[i * dk], dk);
      axpy(decay_from_start, out_state, &b.dq[i * dk], dk);
      for (int c = 0; c < dv; ++c) {
        b.scaled_d_out[i * dv + c] = decay_from_start * b.d_out[i * dv + c];
      }
    }
    const float chunk_decay = s.decays.from_start(L - 1);
    for (int64_t e = 0; e < int64_t(dk) * dv; ++e) {
      b.ds0_t[e] = chunk_decay * b.ds_t[e];
    }
    // In dot's lanes: a sum of Dk Dv terms one after another waits on each
    // add (it took a quarter of chunk_carry_backward's time).
    b.entry_terms[L - 1] += dot(b.ds_t.data(), entry_t, dk * dv);
    return {s.q.data(), b.scaled_d_out.data()};
  }

  // dk_j += e_j (V' dS)_j, and e_j's gradient (V' dS)_j . k_j.
  static void exit_backward(
      const GatedDeltaParams& p, int L, BackwardScratch& b) {
    const int dk = p.key_dim;
    const ChunkScratch& s = b.s;
    for (int j = 0; j < L; ++j) {
      const float e = s.decays.to_end(j);
      const float* row = &b.row_tmp[j * dk];
      for (int c = 0; c < dk; ++c) {
        b.dk[j * dk + c] += e * row[c];
      }
      b.exit_terms[j] = dot(row, &s.k[j * dk], dk);
    }
  }

  // Kb_i = beta_i Gamma_i k_i: dk_i += beta_i Gamma_i dKb_i; dbeta_i gains
  // Gamma_i dKb_i . k_i and Gamma_i's gradient beta_i dKb_i . k_i.
  static float scaled_key_backward(
      const GatedDeltaParams& p, int i, BackwardScratch& b) {
    const int dk = p.key_dim;
    const ChunkScratch& s = b.s;
    const float decay_from_start = s.decays.from_start(i);
    const float w_scale = s.beta[i] * decay_from_start;
    const float* d_scaled_k = &b.d_scaled_k[i * dk];
    const float k_term = dot(d_scaled_k, &s.k[i * dk], dk);
    axpy(w_scale, d_scaled_k, &b.dk[i * dk], dk);
    b.entry_terms[i] += s.beta[i] * k_term;
    return decay_from_start * k_term;
  }

  // With dAk = dA o beta_i decay(i, j) (into b.x, read): dk += dAk K +
  // dAk^T K and dbeta_i gains sum_j dA_ij decay(i, j) k_i.k_j; b.da keeps
  // beta_i dA_ij.
  static void inverse_backward(
      const GatedDeltaParams& p, int L, BackwardScratch& b) {
    const ChunkScratch& s = b.s;
    for (int i = 0; i < L; ++i) {
      float dbeta = 0.0f;
      for (int j = 0; j < L; ++j) {
        const int e = i * C + j;
        if (j >= i) {
          b.x[e] = b.da[e] = 0.0f;
          continue;
        }
        const float decayed = s.decay[e] * b.da[e];
        dbeta += decayed * b.k_gram[e];
        b.x[e] = s.beta[i] * decayed;
        b.da[e] *= s.beta[i];
      }
      b.dbeta[i] += dbeta;
    }
    row_column_products(
        L,
        p.key_dim,
        b.x.data(),
        s.k.data(),
        s.k.data(),
        b.dk.data(),
        b.dk.data(),
        Output::Add);
  }

  // dM_ij (q_i . k_j) + beta_i dA_ij (k_i . k_j).
  static RowFactor pair_term(const BackwardScratch& b, int i, int j, int) {
    const int e = i * C + j;
    return {b.dm[e] * b.s.qk[e] + b.da[e] * b.k_gram[e]};
  }
};

}  // namespace

template <typename T>
void chunked_head_backward(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    ChunkedBackwardTrace* trace) {
  if (p.per_key_gates) {
    key_chunked_head_backward(p, h, trace);
  } else {
    chunked_backward::head_backward<ScalarGates>(p, h, trace);
  }
}

template void chunked_head_backward<float>(
    const GatedDeltaParams&,
    const BackwardHeadView<float>&,
    ChunkedBackwardTrace*);
template void chunked_head_backward<mlx::core::float16_t>(
    const GatedDeltaParams&,
    const BackwardHeadView<mlx::core::float16_t>&,
    ChunkedBackwardTrace*);
template void chunked_head_backward<mlx::core::bfloat16_t>(
    const GatedDeltaParams&,
    const BackwardHeadView<mlx::core::bfloat16_t>&,
    ChunkedBackwardTrace*);

ChunkedBackwardTrace trace_chunked_backward_stages(
    const GatedDeltaParams& p,
    const BackwardBuffers<float>& buffers,
    int batch,
    int head) {
  // This problem's per-value-head dq and dk, as gated_delta_backward gives
  // each problem.
  const size_t head_grads = size_t(p.tokens) * p.key_dim;
  std::vector<float> dq_head(head_grads), dk_head(head_grads);
  ChunkedBackwardTrace trace;
  chunked_head_backward(
      p,
      backward_head_view(
          p, buffers, batch, head, dq_head.data(), dk_head.data()),
      &trace);
  return trace;
}

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
