// The chunked WY form's backward with per-key-channel gates on the CPU:
// PerKeyGates, the parts of chunked_backward.cpp's stages that differ when
// each channel c of the state decays by its own decay(i, j, c) =
// exp(G_ic - G_jc) (G the in-chunk cumulative log decay). With Gamma_ic =
// decay(i, -1, c) and e_jc = decay(L-1, j, c) the forward of a chunk is
// (chunked_stages.h, key_chunk_decays.h):
//   A_ij = beta_i Kd_ij,  Kd_ij = sum_c k_ic k_jc decay(i, j, c)  (j < i)
//   U = T diag(beta) V;  W = T Kb,  Kb_ic = beta_i Gamma_ic k_ic
//   V' = U - W S0^T;  O = (Q o Gamma) S0^T + M V',
//   M_ij = sum_c q_ic k_jc decay(i, j, c)  (j <= i)
//   S_end = S0 diag(Gamma_{L-1}) + V'^T (e o K)
// and the reverse keeps the scalar stages' products with these changes:
//   chunk_output_backward   dq = R(dM, K), dk = C(dM, Q), R and C the
//                           products decayed per channel (KeyDecayedProducts)
//   chunk_carry_backward    Gamma and e scale the channels: dq += Gamma o
//                           (dO S0), dk += e o (V' dS), dS0 = dS
//                           diag(Gamma_{L-1}) + dO^T (Q o Gamma) - dV'^T W
//   recompute_w_u_backward  dk += beta Gamma o dKb
//   kkt_inverse_backward    with dKd = diag(beta) dA: dk += R(dKd, K) +
//                           C(dKd, K)
//   gate_cumsum_backward    dgamma and dg per channel
// The gradient of decay(i, j, c) without the decay is channel c's share of
// the product it scales: (dM_ij q_ic + beta_i dA_ij k_ic) k_jc (pair_term),
// dO S0 o Q and beta dKb o K (of Gamma), <dS[:, c], S0[:, c]> (of
// Gamma_{L-1}) and V' dS o K (of e). Chunks with a decay that is not a
// normal float run the recurrent reverse (chunked_backward_stages.h), so no
// product here meets a wipe.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/chunked_backward_stages.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

namespace {

constexpr int C = kChunkSize;

// For the diagonal block of rows [first, end): `product[c]` is 1 for the
// channels whose G spreads over at most kProductLogLimit across the block
// (so every factor of the block's products lies in [exp(-limit), 1] and the
// row's rescaling in [1, exp(limit)]), 0 for the rest, which `pairs` lists.
void select_product_channels(
    const float* log_sums,
    int first,
    int end,
    int dk,
    float* product,
    std::vector<int>& pairs) {
  pairs.clear();
  for (int c = 0; c < dk; ++c) {
    float lowest = log_sums[size_t(first) * dk + c], highest = lowest;
    for (int j = first + 1; j < end; ++j) {
      lowest = std::min(lowest, log_sums[size_t(j) * dk + c]);
      highest = std::max(highest, log_sums[size_t(j) * dk + c]);
    }
    const bool in_limit = highest - lowest <= kProductLogLimit;
    product[c] = in_limit ? 1.0f : 0.0f;
    if (!in_limit) {
      pairs.push_back(c);
    }
  }
}

}  // namespace

// Per sub-chunk [first, end) of the output's rows (last = end - 1), as
// matrix products whose factors are at most 1. Rows (R): the earlier
// columns j < first go through row `first`: decay(i, j, c) = decay(i, first,
// c) decay(first, j, c), the second in the operand and the first scaling the
// product's rows; the diagonal block goes through row `last`: decay(i, j, c)
// = decay(last, j, c) / decay(last, i, c), the operand at most 1 and the rows
// rescaled by at most exp(kProductLogLimit), for the channels
// select_product_channels allows; the others pair by pair. Columns (C) are
// the same with time reversed: the later rows i >= end go through row
// `last`, decay(i, j, c) = decay(i, last, c) decay(last, j, c); the diagonal
// block through row `first`, decay(i, first, c) / decay(j, first, c).
template <bool kColumns>
void KeyDecayedProducts::product(
    const KeyChunkDecays& d,
    int L,
    int dk,
    const float* x,
    const float* operand,
    float* out) {
  const float* log_sums = d.log_sums();
  // The exponent G_i - G_j of decay(i, j) between an output row's index and
  // a summed one: (i, j) is (out, other) for rows, (other, out) for columns.
  auto gap = [](float out_log, float other_log) {
    return kColumns ? other_log - out_log : out_log - other_log;
  };
  std::fill(out, out + size_t(L) * dk, 0.0f);
  for (int first = 0; first < L; first += kSubChunkSize) {
    const int n = std::min(kSubChunkSize, L - first);
    const int end = first + n, last = end - 1;
    const float* g_rows = log_sums + size_t(first) * dk;
    float* out_rows = out + size_t(first) * dk;
    // The indices outside the sub-chunk that its rows sum over, and the
    // row they go through.
    const int far_begin = kColumns ? end : 0, far_end = kColumns ? L : first;
    const float* g_far = log_sums + size_t(kColumns ? last : first) * dk;
    if (far_begin < far_end) {
      for (int u = far_begin; u < far_end; ++u) {
        const float* g_u = log_sums + size_t(u) * dk;
        const float* operand_u = operand + size_t(u) * dk;
        float* decayed = &operand_[size_t(u) * dk];
#pragma omp simd
        for (int c = 0; c < dk; ++c) {
          decayed[c] = decay_exp(gap(g_far[c], g_u[c])) * operand_u[c];
        }
      }
      const MatrixA far = kColumns ? MatrixA{x + far_begin * C + first, 1, C}
                                   : MatrixA{x + first * C + far_begin, C, 1};
      gemm(
          n,
          dk,
          far_end - far_begin,
          1.0f,
          far,
          &operand_[size_t(far_begin) * dk],
          dk,
          out_rows,
          dk);
      for (int r = 0; r < n; ++r) {
        const float* g_o = g_rows + size_t(r) * dk;
        float* row = out_rows + size_t(r) * dk;
#pragma omp simd
        for (int c = 0; c < dk; ++c) {
          row[c] *= decay_exp(gap(g_o[c], g_far[c]));
        }
      }
    }
    float* in_product = product_.data();
    select_product_channels(
        log_sums, first, end, dk, in_product, pair_channels_);
    const float* g_near = log_sums + size_t(kColumns ? first : last) * dk;
    for (int u = first; u < end; ++u) {
      const float* g_u = log_sums + size_t(u) * dk;
      const float* operand_u = operand + size_t(u) * dk;
      float* decayed = &operand_[size_t(u) * dk];
#pragma omp simd
      for (int c = 0; c < dk; ++c) {
        decayed[c] =
            in_product[c] * decay_exp(gap(g_near[c], g_u[c])) * operand_u[c];
      }
    }
    std::fill(block_.begin(), block_.end(), 0.0f);
    const float* diagonal = x + first * C + first;
    gemm(
        n,
        dk,
        n,
        1.0f,
        kColumns ? MatrixA{diagonal, 1, C} : MatrixA{diagonal, C, 1},
        &operand_[size_t(first) * dk],
        dk,
        block_.data(),
        dk,
        kColumns ? Triangle::UpperA : Triangle::LowerA);
    for (int r = 0; r < n; ++r) {
      const float* g_o = g_rows + size_t(r) * dk;
      const float* block = &block_[size_t(r) * dk];
      float* row = out_rows + size_t(r) * dk;
#pragma omp simd
      for (int c = 0; c < dk; ++c) {
        const float scale = decay_exp(gap(g_o[c], g_near[c]));
        row[c] += in_product[c] > 0.0f ? scale * block[c] : 0.0f;
      }
    }
    for (const int c : pair_channels_) {
      for (int o = first; o < end; ++o) {
        float sum = 0.0f;
        // Rows sum over j in [first, o], columns over i in [o, end).
        const int u_begin = kColumns ? o : first,
                  u_end = kColumns ? end : o + 1;
        for (int u = u_begin; u < u_end; ++u) {
          const int i = kColumns ? u : o, j = kColumns ? o : u;
          sum = multiply_add(
              x[i * C + j] * d(i, j, c), operand[size_t(u) * dk + c], sum);
        }
        out[size_t(o) * dk + c] += sum;
      }
    }
  }
}

namespace {

// Per-key gates: one decay per row and key channel.
struct PerKeyGates {
  // The factors of a row, one per channel.
  using RowFactor = const float*;
  static RowFactor from_start(const ChunkScratch& s, int i, int dk) {
    return s.key_decays.from_start() + size_t(i) * dk;
  }
  static RowFactor to_end(const ChunkScratch& s, int j, int dk) {
    return s.key_decays.to_end() + size_t(j) * dk;
  }

  static void forward_grams(
      int dk, int L, ChunkScratch& s, ChunkStore& store, int chunk) {
    transpose(s.k.data(), L, dk, dk, s.k_transposed.data(), C);
    key_decayed_grams(s);
    std::copy(
        s.qk_decayed.begin(),
        s.qk_decayed.end(),
        &store.qk[size_t(chunk) * C * C]);
  }

  static void reverse_grams(
      int /*dk*/,
      int /*L*/,
      BackwardScratch& b,
      const ChunkStore& store,
      int chunk) {
    b.qk = &store.qk[size_t(chunk) * C * C];
  }

  static const float* output_matrix(int /*L*/, BackwardScratch& b) {
    return b.qk;
  }

  // dq = R(dM, K), dk = C(dM, Q).
  static void output_products(
      const GatedDeltaParams& p, int L, BackwardScratch& b) {
    const int dk = p.key_dim;
    const ChunkScratch& s = b.s;
    for (int i = 0; i < L; ++i) {  // LowerC's partial sums above the diagonal
      std::fill(&b.dm[i * C + i + 1], &b.dm[i * C + C], 0.0f);
    }
    b.products.product<false>(
        s.key_decays, L, dk, b.dm.data(), s.k.data(), b.dq.data());
    b.products.product<true>(
        s.key_decays, L, dk, b.dm.data(), s.q.data(), b.dk.data());
  }

  // The entry state's share of the output, S0 (Gamma_i o q_i), and of the
  // exit state, S0 diag(Gamma_{L-1}): with P = dO S0, dq += Gamma o P and
  // Gamma's gradient gains P o Q; dS0 = dS diag(Gamma_{L-1}) + (Q o
  // Gamma)^T dO, and each channel's Gamma_{L-1} gains <dS[:, c], S0[:, c]>.
  // end_keys holds Q o Gamma for the product until the exit state's part
  // needs it.
  static EntryOperands entry_backward(
      const GatedDeltaParams& p,
      int L,
      BackwardScratch& b,
      const float* entry_t) {
    const int dk = p.key_dim, dv = p.value_dim;
    const ChunkScratch& s = b.s;
    const float* from_start = s.key_decays.from_start();
    for (int e = 0; e < L * dk; ++e) {
      const float d = from_start[e] * b.out_state[e];
      b.dq[e] += d;
      b.entry_terms[e] += b.out_state[e] * s.q[e];
      b.end_keys[e] = from_start[e] * s.q[e];
    }
    const float* chunk_decays = from_start + size_t(L - 1) * dk;
    float* last_entry_terms = &b.entry_terms[size_t(L - 1) * dk];
    for (int c = 0; c < dk; ++c) {
      float term = 0.0f;
      for (int e = c * dv; e < (c + 1) * dv; ++e) {
        b.ds0_t[e] = chunk_decays[c] * b.ds_t[e];
        term += b.ds_t[e] * entry_t[e];
      }
      last_entry_terms[c] += term;
    }
    return {b.end_keys.data(), b.d_out.data()};
  }

  // dk += e o (V' dS), and e's gradient (V' dS) o K.
  static void exit_backward(
      const GatedDeltaParams& p, int L, BackwardScratch& b) {
    const ChunkScratch& s = b.s;
    const float* to_end = s.key_decays.to_end();
    for (int e = 0; e < L * p.key_dim; ++e) {
      b.dk[e] += to_end[e] * b.row_tmp[e];
      b.exit_terms[e] = b.row_tmp[e] * s.k[e];
    }
  }

  // Kb's rows scaled per channel by beta_i Gamma_ic.
  static float scaled_key_backward(
      const GatedDeltaParams& p, int i, BackwardScratch& b) {
    const int dk = p.key_dim;
    const ChunkScratch& s = b.s;
    const float* from_start = s.key_decays.from_start();
    const float beta = s.beta[i];
    float k_term = 0.0f;
    for (int c = 0; c < dk; ++c) {
      const int e = i * dk + c;
      const float decayed_k = from_start[e] * s.k[e];
      k_term += b.d_scaled_k[e] * decayed_k;
      b.dk[e] += beta * from_start[e] * b.d_scaled_k[e];
      b.entry_terms[e] += beta * b.d_scaled_k[e] * s.k[e];
    }
    return k_term;
  }

  // dbeta_i gains sum_j dA_ij Kd_ij; with dKd = diag(beta) dA (kept in b.da
  // for pair_term), dk += R(dKd, K) + C(dKd, K).
  static void inverse_backward(
      const GatedDeltaParams& p, int L, BackwardScratch& b) {
    const int dk = p.key_dim;
    const ChunkScratch& s = b.s;
    for (int i = 0; i < L; ++i) {
      float dbeta = 0.0f;
      for (int j = 0; j < L; ++j) {
        float& da = b.da[i * C + j];
        if (j >= i) {
          da = 0.0f;
          continue;
        }
        dbeta += da * b.k_gram[i * C + j];
        da *= s.beta[i];
      }
      b.dbeta[i] += dbeta;
    }
    b.products.product<false>(
        s.key_decays, L, dk, b.da.data(), s.k.data(), b.row_tmp.data());
    b.products.product<true>(
        s.key_decays, L, dk, b.da.data(), s.k.data(), b.key_columns.data());
    for (int e = 0; e < L * dk; ++e) {
      b.dk[e] += b.row_tmp[e] + b.key_columns[e];
    }
  }

  // Per channel c: (dM_ij q_ic + beta_i dA_ij k_ic) k_jc.
  struct PairTerm {
    float d_output, d_inverse;
    const float *q_i, *k_i, *k_j;
    float operator[](int c) const {
      return (d_output * q_i[c] + d_inverse * k_i[c]) * k_j[c];
    }
  };
  static PairTerm pair_term(const BackwardScratch& b, int i, int j, int dk) {
    const int e = i * C + j;
    return {
        b.dm[e],
        b.da[e],
        &b.s.q[size_t(i) * dk],
        &b.s.k[size_t(i) * dk],
        &b.s.k[size_t(j) * dk]};
  }
};

}  // namespace

template <typename T>
void key_chunked_head_backward(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    ChunkedBackwardTrace* trace) {
  chunked_backward::head_backward<PerKeyGates>(p, h, trace);
}

template void key_chunked_head_backward<float>(
    const GatedDeltaParams&,
    const BackwardHeadView<float>&,
    ChunkedBackwardTrace*);
template void key_chunked_head_backward<mlx::core::float16_t>(
    const GatedDeltaParams&,
    const BackwardHeadView<mlx::core::float16_t>&,
    ChunkedBackwardTrace*);
template void key_chunked_head_backward<mlx::core::bfloat16_t>(
    const GatedDeltaParams&,
    const BackwardHeadView<mlx::core::bfloat16_t>&,
    ChunkedBackwardTrace*);

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
