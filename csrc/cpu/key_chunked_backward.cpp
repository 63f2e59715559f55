// The chunked WY form's backward with per-key-channel gates on the CPU: the
// stages of chunked_backward.cpp, each channel c of the state decaying by
// its own decay(i, j, c) = exp(G_ic - G_jc) (G the in-chunk cumulative log
// decay). With Gamma_ic = decay(i, -1, c) and e_jc = decay(L-1, j, c) the
// forward of a chunk is (chunked_stages.h, key_chunk_decays.h):
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
//   gate_cumsum_backward    dG, dg and the linear decay's gradient per channel
// The gate terms come out of the same products: the term of entry (i, j) of
// a decayed product in channel c, a_ic X_ij decay(i, j, c) b_jc, adds to
// dG_ic and subtracts from dG_jc, so R gives a_ic R_ic at i and C gives
// -b_jc C_jc at j; where Gamma or e scales a channel the term is the
// scaled operand times its gradient. Chunks with a decay that is not a
// normal float run the recurrent reverse (chunked_backward.cpp), so no
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

// Per sub-chunk of rows [first, end), last = end - 1. The earlier columns
// j < first go through row `first`: decay(i, j, c) = decay(i, first, c)
// decay(first, j, c), both at most 1, the second in the operand and the
// first scaling the product's rows. The diagonal block goes through row
// `last`: decay(i, j, c) = decay(last, j, c) / decay(last, i, c), the operand
// at most 1 and the rows rescaled by at most exp(kProductLogLimit), for the
// channels select_product_channels allows; the others pair by pair.
void KeyDecayedProducts::rows(
    const KeyChunkDecays& d,
    int L,
    int dk,
    const float* x,
    const float* b,
    float* out) {
  const float* log_sums = d.log_sums();
  std::fill(out, out + size_t(L) * dk, 0.0f);
  for (int first = 0; first < L; first += kSubChunkSize) {
    const int n = std::min(kSubChunkSize, L - first);
    const int end = first + n, last = end - 1;
    const float* g_first = log_sums + size_t(first) * dk;
    const float* g_last = log_sums + size_t(last) * dk;
    float* out_rows = out + size_t(first) * dk;
    if (first > 0) {
      for (int j = 0; j < first; ++j) {
        const float* g_j = log_sums + size_t(j) * dk;
        const float* b_j = b + size_t(j) * dk;
        float* operand = &operand_[size_t(j) * dk];
#pragma omp simd
        for (int c = 0; c < dk; ++c) {
          operand[c] = decay_exp(g_first[c] - g_j[c]) * b_j[c];
        }
      }
      gemm(
          n,
          dk,
          first,
          1.0f,
          {x + first * C, C, 1},
          operand_.data(),
          dk,
          out_rows,
          dk);
      for (int r = 0; r < n; ++r) {
        const float* g_i = g_first + size_t(r) * dk;
        float* row = out_rows + size_t(r) * dk;
#pragma omp simd
        for (int c = 0; c < dk; ++c) {
          row[c] *= decay_exp(g_i[c] - g_first[c]);
        }
      }
    }
    float* product = product_.data();
    select_product_channels(log_sums, first, end, dk, product, pair_channels_);
    for (int j = first; j < end; ++j) {
      const float* g_j = log_sums + size_t(j) * dk;
      const float* b_j = b + size_t(j) * dk;
      float* operand = &operand_[size_t(j) * dk];
#pragma omp simd
      for (int c = 0; c < dk; ++c) {
        operand[c] = product[c] * decay_exp(g_last[c] - g_j[c]) * b_j[c];
      }
    }
    std::fill(block_.begin(), block_.end(), 0.0f);
    gemm(
        n,
        dk,
        n,
        1.0f,
        {x + first * C + first, C, 1},
        &operand_[size_t(first) * dk],
        dk,
        block_.data(),
        dk,
        Triangle::LowerA);
    for (int r = 0; r < n; ++r) {
      const float* g_i = g_first + size_t(r) * dk;
      const float* block = &block_[size_t(r) * dk];
      float* row = out_rows + size_t(r) * dk;
#pragma omp simd
      for (int c = 0; c < dk; ++c) {
        const float scale = decay_exp(g_i[c] - g_last[c]);
        row[c] += product[c] > 0.0f ? scale * block[c] : 0.0f;
      }
    }
    for (const int c : pair_channels_) {
      for (int i = first; i < end; ++i) {
        float sum = 0.0f;
        for (int j = first; j <= i; ++j) {
          sum = multiply_add(
              x[i * C + j] * d(i, j, c), b[size_t(j) * dk + c], sum);
        }
        out[size_t(i) * dk + c] += sum;
      }
    }
  }
}

// As rows, transposed. Per sub-chunk of columns [first, end): the later
// rows i >= end go through row `last`: decay(i, j, c) = decay(i, last, c)
// decay(last, j, c), both at most 1; the diagonal block through row
// `first`: decay(i, j, c) = decay(i, first, c) / decay(j, first, c).
void KeyDecayedProducts::columns(
    const KeyChunkDecays& d,
    int L,
    int dk,
    const float* x,
    const float* a,
    float* out) {
  const float* log_sums = d.log_sums();
  std::fill(out, out + size_t(L) * dk, 0.0f);
  for (int first = 0; first < L; first += kSubChunkSize) {
    const int n = std::min(kSubChunkSize, L - first);
    const int end = first + n, last = end - 1;
    const float* g_first = log_sums + size_t(first) * dk;
    const float* g_last = log_sums + size_t(last) * dk;
    float* out_rows = out + size_t(first) * dk;
    if (end < L) {
      for (int i = end; i < L; ++i) {
        const float* g_i = log_sums + size_t(i) * dk;
        const float* a_i = a + size_t(i) * dk;
        float* operand = &operand_[size_t(i) * dk];
#pragma omp simd
        for (int c = 0; c < dk; ++c) {
          operand[c] = decay_exp(g_i[c] - g_last[c]) * a_i[c];
        }
      }
      gemm(
          n,
          dk,
          L - end,
          1.0f,
          {x + end * C + first, 1, C},
          &operand_[size_t(end) * dk],
          dk,
          out_rows,
          dk);
      for (int r = 0; r < n; ++r) {
        const float* g_j = g_first + size_t(r) * dk;
        float* row = out_rows + size_t(r) * dk;
#pragma omp simd
        for (int c = 0; c < dk; ++c) {
          row[c] *= decay_exp(g_last[c] - g_j[c]);
        }
      }
    }
    float* product = product_.data();
    select_product_channels(log_sums, first, end, dk, product, pair_channels_);
    for (int i = first; i < end; ++i) {
      const float* g_i = log_sums + size_t(i) * dk;
      const float* a_i = a + size_t(i) * dk;
      float* operand = &operand_[size_t(i) * dk];
#pragma omp simd
      for (int c = 0; c < dk; ++c) {
        operand[c] = product[c] * decay_exp(g_i[c] - g_first[c]) * a_i[c];
      }
    }
    std::fill(block_.begin(), block_.end(), 0.0f);
    gemm(
        n,
        dk,
        n,
        1.0f,
        {x + first * C + first, 1, C},
        &operand_[size_t(first) * dk],
        dk,
        block_.data(),
        dk,
        Triangle::UpperA);
    for (int r = 0; r < n; ++r) {
      const float* g_j = g_first + size_t(r) * dk;
      const float* block = &block_[size_t(r) * dk];
      float* row = out_rows + size_t(r) * dk;
#pragma omp simd
      for (int c = 0; c < dk; ++c) {
        const float scale = decay_exp(g_first[c] - g_j[c]);
        row[c] += product[c] > 0.0f ? scale * block[c] : 0.0f;
      }
    }
    for (const int c : pair_channels_) {
      for (int j = first; j < end; ++j) {
        float sum = 0.0f;
        for (int i = j; i < end; ++i) {
          sum = multiply_add(
              x[i * C + j] * d(i, j, c), a[size_t(i) * dk + c], sum);
        }
        out[size_t(j) * dk + c] += sum;
      }
    }
  }
}

// chunk_output_backward: dV' = M^T dO, dM = dO V'^T (lower); dq = R(dM, K),
// dk = C(dM, Q) and their gate terms q o dq - k o dk.
void key_chunk_output_backward(
    const GatedDeltaParams& p, int L, BackwardScratch& b) {
  const int dk = p.key_dim, dv = p.value_dim;
  const ChunkScratch& s = b.s;
  fill_zero(b.d_corrected);
  gemm(
      L,
      dv,
      L,
      1.0f,
      {b.qk, 1, C},
      b.d_out.data(),
      dv,
      b.d_corrected.data(),
      dv,
      Triangle::UpperA);
  transpose(b.corrected, L, dv, dv, b.corrected_t.data(), C);
  fill_zero(b.dm);
  gemm(
      L,
      L,
      dv,
      1.0f,
      {b.d_out.data(), dv, 1},
      b.corrected_t.data(),
      C,
      b.dm.data(),
      C,
      Triangle::LowerC);
  for (int i = 0; i < L; ++i) {  // LowerC's partial sums above the diagonal
    std::fill(&b.dm[i * C + i + 1], &b.dm[i * C + C], 0.0f);
  }
  b.products.rows(s.key_decays, L, dk, b.dm.data(), s.k.data(), b.dq.data());
  b.products.columns(s.key_decays, L, dk, b.dm.data(), s.q.data(), b.dk.data());
  for (int e = 0; e < L * dk; ++e) {
    b.key_d_log[e] += s.q[e] * b.dq[e] - s.k[e] * b.dk[e];
  }
}

// chunk_carry_backward: the entry state's share of the output, S0 (Gamma_i
// o q_i), and of the exit state, S0 diag(Gamma_{L-1}) + V'^T (e o K), then
// V' = U - W S0^T (delta_backward).
void key_chunk_carry_backward(
    const GatedDeltaParams& p,
    int L,
    BackwardScratch& b,
    const float* entry_t,
    const float* ds) {
  const int dk = p.key_dim, dv = p.value_dim;
  const ChunkScratch& s = b.s;
  const float* from_start = s.key_decays.from_start();
  const float* to_end = s.key_decays.to_end();

  // With P = dO S0: dq += Gamma o P and its gate term; end_keys holds
  // Q o Gamma for dS0 until the exit state's part needs it.
  fill_zero(b.out_state);
  gemm(
      L,
      dk,
      dv,
      1.0f,
      {b.d_out.data(), dv, 1},
      b.entry.data(),
      dk,
      b.out_state.data(),
      dk);
  for (int e = 0; e < L * dk; ++e) {
    const float d = from_start[e] * b.out_state[e];
    b.dq[e] += d;
    b.key_d_log[e] += d * s.q[e];
    b.end_keys[e] = from_start[e] * s.q[e];
  }
  // dS0 = dS diag(Gamma_{L-1}) + dO^T (Q o Gamma), transposed; each channel's
  // chunk decay gains <dS[:, c], S0[:, c]>.
  const float* chunk_decays = from_start + size_t(L - 1) * dk;
  float* last_d_log = &b.key_d_log[size_t(L - 1) * dk];
  for (int c = 0; c < dk; ++c) {
    float term = 0.0f;
    for (int e = c * dv; e < (c + 1) * dv; ++e) {
      b.ds0_t[e] = chunk_decays[c] * b.ds_t[e];
      term += b.ds_t[e] * entry_t[e];
    }
    last_d_log[c] += chunk_decays[c] * term;
  }
  gemm(
      dk,
      dv,
      L,
      1.0f,
      {b.end_keys.data(), 1, dk},
      b.d_out.data(),
      dv,
      b.ds0_t.data(),
      dv);

  // The exit state's sum V'^T (e o K).
  for (int e = 0; e < L * dk; ++e) {
    b.end_keys[e] = to_end[e] * s.k[e];
  }
  gemm(
      L,
      dv,
      dk,
      1.0f,
      {b.end_keys.data(), dk, 1},
      b.ds_t.data(),
      dv,
      b.d_corrected.data(),
      dv);
  fill_zero(b.row_tmp);
  gemm(L, dk, dv, 1.0f, {b.corrected, dv, 1}, ds, dk, b.row_tmp.data(), dk);
  for (int j = 0; j < L; ++j) {
    for (int c = 0; c < dk; ++c) {
      const int e = j * dk + c;
      const float d = to_end[e] * b.row_tmp[e];
      b.dk[e] += d;
      const float term = d * s.k[e];
      last_d_log[c] += term;
      b.key_d_log[e] -= term;
    }
  }
  delta_backward(p, L, b);
}

// recompute_w_u_backward: as the scalar stage, Kb's rows scaled per channel
// by beta_i Gamma_ic.
template <typename T>
void key_recompute_w_u_backward(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    int start,
    int L,
    BackwardScratch& b) {
  const int dk = p.key_dim, dv = p.value_dim;
  const ChunkScratch& s = b.s;
  const float* from_start = s.key_decays.from_start();
  for (int i = 0; i < L; ++i) {
    float* v_row = &b.v_rows[i * dv];
    load_vector(h.v + (start + i) * h.v_token_stride, v_row, dv);
    for (int c = 0; c < dv; ++c) {
      b.scaled_v_t[c * C + i] = s.beta[i] * v_row[c];
    }
    for (int c = 0; c < dk; ++c) {
      const int e = i * dk + c;
      b.scaled_k_t[c * C + i] = s.beta[i] * from_start[e] * s.k[e];
    }
  }
  w_u_products(p, L, b);
  for (int i = 0; i < L; ++i) {
    T* dv_out = h.dv + (start + i) * h.v_token_stride;
    if (!s.active[i]) {
      zero_output_row(dv_out, dv);
      continue;
    }
    const float beta = s.beta[i];
    const float* d_scaled_v = &b.d_scaled_v[i * dv];
    for (int c = 0; c < dv; ++c) {
      dv_out[c] = T(beta * d_scaled_v[c]);
    }
    float k_term = 0.0f;
    for (int c = 0; c < dk; ++c) {
      const int e = i * dk + c;
      const float decayed_k = from_start[e] * s.k[e];
      k_term += b.d_scaled_k[e] * decayed_k;
      const float d = beta * from_start[e] * b.d_scaled_k[e];
      b.dk[e] += d;
      b.key_d_log[e] += d * s.k[e];
    }
    b.dbeta[i] += dot(d_scaled_v, &b.v_rows[i * dv], dv) + k_term;
  }
}

// kkt_inverse_backward: dA = -T^T dT T^T (strictly lower); dbeta_i gains
// sum_j dA_ij Kd_ij; with dKd = diag(beta) dA, dk += R(dKd, K) + C(dKd, K)
// and the gate terms k o (R - C).
void key_kkt_inverse_backward(
    const GatedDeltaParams& p, int L, BackwardScratch& b) {
  const int dk = p.key_dim;
  const ChunkScratch& s = b.s;
  inverse_gradient(L, b);
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
  b.products.rows(
      s.key_decays, L, dk, b.da.data(), s.k.data(), b.row_tmp.data());
  b.products.columns(
      s.key_decays, L, dk, b.da.data(), s.k.data(), b.key_columns.data());
  for (int e = 0; e < L * dk; ++e) {
    const float rows = b.row_tmp[e], columns = b.key_columns[e];
    b.dk[e] += rows + columns;
    b.key_d_log[e] += s.k[e] * (rows - columns);
  }
}

// gate_cumsum_backward: per channel dg_tc = sum_{i >= t} dG_ic and the
// linear decay's gradient dg_tc / exp(g_tc); then the chunk's rows of every
// per-token gradient but dv, 0 where masked.
template <typename T>
void key_gate_cumsum_backward(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    int start,
    int L,
    BackwardScratch& b) {
  const int dk = p.key_dim;
  const ChunkScratch& s = b.s;
  float* suffix = b.key_columns.data();  // free after kkt_inverse_backward
  std::fill(suffix, suffix + dk, 0.0f);
  for (int i = L - 1; i >= 0; --i) {
    const float* d_log = &b.key_d_log[size_t(i) * dk];
    for (int c = 0; c < dk; ++c) {
      suffix[c] += d_log[c];
    }
    const int t = start + i;
    float* dq_out = h.dq_head + t * h.head_grad_token_stride;
    float* dk_out = h.dk_head + t * h.head_grad_token_stride;
    float* dg_out = h.dg + t * h.g_token_stride;
    float* dgamma_out = h.dgamma + t * h.g_token_stride;
    float* dbeta_out = h.dbeta + t * h.gate_token_stride;
    if (!s.active[i]) {
      std::fill(dq_out, dq_out + dk, 0.0f);
      std::fill(dk_out, dk_out + dk, 0.0f);
      std::fill(dg_out, dg_out + dk, 0.0f);
      std::fill(dgamma_out, dgamma_out + dk, 0.0f);
      *dbeta_out = 0.0f;
      continue;
    }
    std::copy(&b.dq[i * dk], &b.dq[(i + 1) * dk], dq_out);
    std::copy(&b.dk[i * dk], &b.dk[(i + 1) * dk], dk_out);
    const float* g = h.g + t * h.g_token_stride;
    for (int c = 0; c < dk; ++c) {
      dg_out[c] = suffix[c];
      dgamma_out[c] = suffix[c] / std::exp(g[c]);
    }
    *dbeta_out = b.dbeta[i];
  }
}

template void key_recompute_w_u_backward<float>(
    const GatedDeltaParams&,
    const BackwardHeadView<float>&,
    int,
    int,
    BackwardScratch&);
template void key_recompute_w_u_backward<mlx::core::float16_t>(
    const GatedDeltaParams&,
    const BackwardHeadView<mlx::core::float16_t>&,
    int,
    int,
    BackwardScratch&);
template void key_recompute_w_u_backward<mlx::core::bfloat16_t>(
    const GatedDeltaParams&,
    const BackwardHeadView<mlx::core::bfloat16_t>&,
    int,
    int,
    BackwardScratch&);
template void key_gate_cumsum_backward<float>(
    const GatedDeltaParams&,
    const BackwardHeadView<float>&,
    int,
    int,
    BackwardScratch&);
template void key_gate_cumsum_backward<mlx::core::float16_t>(
    const GatedDeltaParams&,
    const BackwardHeadView<mlx::core::float16_t>&,
    int,
    int,
    BackwardScratch&);
template void key_gate_cumsum_backward<mlx::core::bfloat16_t>(
    const GatedDeltaParams&,
    const BackwardHeadView<mlx::core::bfloat16_t>&,
    int,
    int,
    BackwardScratch&);

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
