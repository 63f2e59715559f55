// The backward pass of the chunked WY/UT form on the CPU, with O(T / 64)
// states in memory and every step a product of small matrices. The stages
// below are the scalar gates'; per-key gates run key_chunked_backward.cpp's
// in their place, from the same boundary_states and chunk loop.
//
// Per chunk of L tokens with entry state S0 ([Dv, Dk]) the forward is
// (chunked_stages.h; Gamma_i = decay(i, -1), e_j = decay(L-1, j)):
//   A_ij = beta_i decay(i, j) k_i.k_j (j < i);   T = (I + A)^-1
//   U = T Vb,  Vb = diag(beta) V;   W = T Kb,  Kb = diag(beta Gamma) K
//   V' = U - W S0^T                                  (the deltas)
//   O  = diag(Gamma) Q S0^T + M V',  M = decay o Q K^T (lower, with the
//        diagonal);  y = scale O
//   S_end = Gamma_{L-1} S0 + V'^T diag(e) K
// Its reverse, given dO = scale dy and dS = the cotangent of S_end, runs as
// these stages, each named after the forward stage it differentiates
// (docs/stages.md):
//   chunk_output_backward   dV' = M^T dO;  dM = dO V'^T;  with
//                           dMd = dM o decay: dq = dMd K, dk = dMd^T Q
//   chunk_carry_backward    the entry state's share of O and of S_end, and
//                           V' = U - W S0^T:  dq += diag(Gamma) dO S0;
//                           dV' += diag(e) K dS^T;  dk += diag(e) V' dS;
//                           dU = dV';  dW = -dV' S0;  dS0 = Gamma_{L-1} dS
//                           + dO^T diag(Gamma) Q - dV'^T W
//   recompute_w_u_backward  dT = dU Vb^T + dW Kb^T;  dVb = T^T dU;
//                           dKb = T^T dW;  dv = diag(beta) dVb; dk, dbeta
//   kkt_inverse_backward    dA = -T^T dT T^T (strictly lower);  dk from
//                           both sides of k_i.k_j, dbeta
//   gate_cumsum_backward    every decay is exp(G_i - G_j) of the in-chunk
//                           cumulative log decay G, so each term c of
//                           d(decay) decay adds c to dG_i and -c to dG_j;
//                           dg_t = sum_{i >= t} dG_i (a reverse cumulative
//                           sum); d(linear decay)_t = dg_t / exp(g_t)
// dS0 is carried to the previous chunk. The per-value-head dq and dk then go
// through qk_grad_reduce (backward.cpp) like the recurrent form's.
//
// boundary_states runs the forward's stages (qk_norm, gate_cumsum, k_gram,
// kkt_inverse, recompute_w_u, the deltas of chunk_carry, chunk_carry_state)
// once over the chunks and keeps, per chunk, the state entering it and what
// the reverse reads of the chunk's WY work: K K^T, T, W and V' (under two
// states' worth per chunk; T / 64 chunks of one problem per thread). The
// reverse recomputes only the cheap rest (qk_norm, chunk_qk, gate_cumsum).
// The entry state's share of the output, decay(i, -1) S0 q_i, is never
// formed: its gate term is Gamma_i (dO_i S0) . q_i, from the product that
// dq needs anyway. A chunk in which some decay is not a normal
// float (a wipe, gamma == 0, or a subnormal decay) runs the recurrent form's
// reverse instead: its gradient of the linear decay at a wipe is not
// dg / decay, and the recurrent form gives it exactly.
// Masked tokens get exactly zero gradients, written as such.
#include <algorithm>
#include <cfloat>
#include <utility>
#include <vector>

#include "cpu/chunked_backward_stages.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

namespace {

constexpr int C = kChunkSize;

}  // namespace

void delta_backward(const GatedDeltaParams& p, int L, BackwardScratch& b) {
  const int dk = p.key_dim, dv = p.value_dim;
  // V' = U - W S0^T.
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

namespace {

// The forward's view of one problem: what the forward stages read.
template <typename T>
HeadView<T> forward_view(const BackwardHeadView<T>& h) {
  return HeadView<T>{
      h.q,
      h.k,
      h.v,
      h.qk_token_stride,
      h.v_token_stride,
      h.g,
      h.g_token_stride,
      h.beta,
      h.mask,
      h.gate_token_stride,
      nullptr,
      0,
      nullptr,
      nullptr,
      nullptr,
      0,
      nullptr,
      0,
      nullptr};
}

// Whether every active token of the chunk decays by a normal float, the
// condition for the chunked reverse (see the top of this file).
// Per-key gates: every channel's.
template <typename T>
bool normal_decays(
    const GatedDeltaParams& p, const BackwardHeadView<T>& h, int start, int L) {
  const int width = p.gate_width();
  for (int i = 0; i < L; ++i) {
    const int t = start + i;
    if (h.mask && !h.mask[t]) {
      continue;
    }
    const float* g = h.g + t * h.g_token_stride;
    for (int c = 0; c < width; ++c) {
      if (!(std::exp(g[c]) >= FLT_MIN)) {
        return false;
      }
    }
  }
  return true;
}

// boundary_states: the forward's stages over the chunks, keeping what
// ChunkStore holds (per-key gates: key_decayed_grams in place of k_gram).
template <typename T>
void boundary_states(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    ChunkScratch& s,
    ChunkStore& store) {
  const int dk = p.key_dim, dv = p.value_dim;
  const HeadView<T> view = forward_view(h);
  std::vector<float> state_t(store.state_size);
  transpose(h.state_in, dv, dk, dk, state_t.data(), dv);
  for (int c = 0; c < p.num_chunks(); ++c) {
    const int start = c * C;
    const int L = std::min(C, p.tokens - start);
    std::copy(
        state_t.begin(), state_t.end(), &store.entry_t[c * store.state_size]);
    qk_norm(p, view, start, L, s);
    if (p.per_key_gates) {
      transpose(s.k.data(), L, dk, dk, s.k_transposed.data(), C);
      gate_cumsum(p, view, start, L, s);
      key_decayed_grams(s);
      std::copy(
          s.qk_decayed.begin(),
          s.qk_decayed.end(),
          &store.qk[size_t(c) * C * C]);
    } else {
      k_gram(dk, L, s);
      gate_cumsum(p, view, start, L, s);
    }
    kkt_inverse(p, L, s);
    recompute_w_u(p, view, start, L, s);
    // chunk_carry's deltas V' = U - W S0^T only: the output is not needed.
    gemm(
        L,
        dv,
        dk,
        -1.0f,
        {s.w.data(), dk, 1},
        state_t.data(),
        dv,
        s.u.data(),
        dv);
    std::copy(
        s.k_gram.begin(), s.k_gram.end(), &store.k_gram[size_t(c) * C * C]);
    std::copy(
        s.inverse.begin(), s.inverse.end(), &store.inverse[size_t(c) * C * C]);
    std::copy(s.w.begin(), s.w.end(), &store.w[c * store.w_size]);
    std::copy(s.u.begin(), s.u.end(), &store.corrected[c * store.v_size]);
    if (c + 1 < p.num_chunks()) {  // the final state is not needed
      chunk_carry_state(p, L, s, state_t.data());
    }
  }
}

// dO = scale dy, 0 on masked rows (the forward writes 0 there whatever dy).
template <typename T>
void load_output_cotangent(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    int start,
    int L,
    BackwardScratch& b) {
  const int dv = p.value_dim;
  for (int i = 0; i < L; ++i) {
    float* row = &b.d_out[i * dv];
    if (!b.s.active[i]) {
      std::fill(row, row + dv, 0.0f);
      continue;
    }
    load_vector(h.dy + (start + i) * h.v_token_stride, row, dv);
    for (int c = 0; c < dv; ++c) {
      row[c] *= p.scale;
    }
  }
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

// chunk_output_backward: dV' = M^T dO, dM = dO V'^T; then dMd = dM o decay,
// dq = dMd K, dk = dMd^T Q and M's gate terms.
void chunk_output_backward(
    const GatedDeltaParams& p, int L, BackwardScratch& b) {
  const int dk = p.key_dim, dv = p.value_dim;
  ChunkScratch& s = b.s;
  for (int i = 0; i < L; ++i) {
    for (int j = 0; j < L; ++j) {
      b.m[i * C + j] = j <= i ? s.decay[i * C + j] * s.qk[i * C + j] : 0.0f;
    }
  }
  fill_zero(b.d_corrected);
  gemm(
      L,
      dv,
      L,
      1.0f,
      {b.m.data(), 1, C},
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
  decayed_matrix_gate_terms(b.dm.data(), b.m.data(), L, b.d_log);
  for (int i = 0; i < L; ++i) {
    for (int j = 0; j < L; ++j) {
      // The decay matrix is 0 above the diagonal, where LowerC may have
      // left partial sums.
      b.dm[i * C + j] *= s.decay[i * C + j];
    }
  }
  fill_zero(b.dq);
  gemm(
      L,
      dk,
      L,
      1.0f,
      {b.dm.data(), C, 1},
      s.k.data(),
      dk,
      b.dq.data(),
      dk,
      Triangle::LowerA);
  fill_zero(b.dk);
  gemm(
      L,
      dk,
      L,
      1.0f,
      {b.dm.data(), 1, C},
      s.q.data(),
      dk,
      b.dk.data(),
      dk,
      Triangle::UpperA);
}

// chunk_carry_backward: the entry state's share of the output and of the
// exit state, and V' = U - W S0^T. Reads dS (b.ds_t) and the entry state
// (b.entry; `entry_t` transposed), writes dS0 (b.ds0_t), dU (in
// b.d_corrected) and dW.
void chunk_carry_backward(
    const GatedDeltaParams& p,
    int L,
    BackwardScratch& b,
    const float* entry_t,
    const float* ds) {
  const int dk = p.key_dim, dv = p.value_dim;
  ChunkScratch& s = b.s;
  const int64_t size = int64_t(dk) * dv;

  // The inter-chunk output diag(Gamma) Q S0^T: with P = dO S0,
  // dq_i += Gamma_i P_i and the gate term Gamma_i P_i . q_i.
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
  for (int64_t e = 0; e < size; ++e) {
    b.ds0_t[e] = chunk_decay * b.ds_t[e];
    entry_term += b.ds_t[e] * entry_t[e];
  }
  b.d_log[L - 1] += chunk_decay * entry_term;
  gemm(
      dk,
      dv,
      L,
      1.0f,
      {s.q.data(), 1, dk},
      b.scaled_d_out.data(),
      dv,
      b.ds0_t.data(),
      dv);

  // The exit state's sum V'^T diag(e) K.
  for (int j = 0; j < L; ++j) {
    const float e = s.decays.to_end(j);
    for (int c = 0; c < dk; ++c) {
      b.end_keys[j * dk + c] = e * s.k[j * dk + c];
    }
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

  delta_backward(p, L, b);
}

// recompute_w_u_backward: dT = dU Vb^T + dW Kb^T (lower), dVb = T^T dU,
// dKb = T^T dW; then dv = beta dVb, and Vb's and Kb's shares of dk, dbeta and
// the gate.
template <typename T>
void recompute_w_u_backward(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    int start,
    int L,
    BackwardScratch& b) {
  const int dk = p.key_dim, dv = p.value_dim;
  ChunkScratch& s = b.s;
  // Vb^T and Kb^T, built transposed from the rows (0 where masked: beta 0).
  for (int i = 0; i < L; ++i) {
    float* v_row = &b.v_rows[i * dv];
    load_vector(h.v + (start + i) * h.v_token_stride, v_row, dv);
    const float w_scale = s.beta[i] * s.decays.from_start(i);
    for (int c = 0; c < dv; ++c) {
      b.scaled_v_t[c * C + i] = s.beta[i] * v_row[c];
    }
    for (int c = 0; c < dk; ++c) {
      b.scaled_k_t[c * C + i] = w_scale * s.k[i * dk + c];
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
    const float w_scale = beta * s.decays.from_start(i);
    const float* d_scaled_k = &b.d_scaled_k[i * dk];
    const float k_term = dot(d_scaled_k, &s.k[i * dk], dk);
    axpy(w_scale, d_scaled_k, &b.dk[i * dk], dk);
    b.dbeta[i] += dot(d_scaled_v, &b.v_rows[i * dv], dv) +
        s.decays.from_start(i) * k_term;
    b.d_log[i] += w_scale * k_term;
  }
}

// kkt_inverse_backward: dA = -T^T dT T^T on the strictly lower triangle;
// then with dAk = dA o beta_i decay(i, j): dk += dAk K + dAk^T K, and A's
// shares of dbeta and the gate.
void kkt_inverse_backward(
    const GatedDeltaParams& p, int L, BackwardScratch& b) {
  const int dk = p.key_dim;
  ChunkScratch& s = b.s;
  inverse_gradient(L, b);
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
  gemm(
      L,
      dk,
      L,
      1.0f,
      {b.da.data(), C, 1},
      s.k.data(),
      dk,
      b.dk.data(),
      dk,
      Triangle::LowerA);
  gemm(
      L,
      dk,
      L,
      1.0f,
      {b.da.data(), 1, C},
      s.k.data(),
      dk,
      b.dk.data(),
      dk,
      Triangle::UpperA);
}

// gate_cumsum_backward: dg_t = sum_{i >= t} dG_i, the linear decay's
// gradient dg_t / exp(g_t); then the chunk's rows of every per-token
// gradient but dv (recompute_w_u_backward wrote it), 0 where masked.
template <typename T>
void gate_cumsum_backward(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    int start,
    int L,
    BackwardScratch& b) {
  const int dk = p.key_dim;
  const ChunkScratch& s = b.s;
  float suffix = 0.0f;
  for (int i = L - 1; i >= 0; --i) {
    suffix += b.d_log[i];
    const int t = start + i;
    float* dq_out = h.dq_head + t * h.head_grad_token_stride;
    float* dk_out = h.dk_head + t * h.head_grad_token_stride;
    float* dg_out = h.dg + t * h.g_token_stride;
    float* dgamma_out = h.dgamma + t * h.g_token_stride;
    float* dbeta_out = h.dbeta + t * h.gate_token_stride;
    if (!s.active[i]) {
      std::fill(dq_out, dq_out + dk, 0.0f);
      std::fill(dk_out, dk_out + dk, 0.0f);
      *dg_out = *dgamma_out = *dbeta_out = 0.0f;
      continue;
    }
    std::copy(&b.dq[i * dk], &b.dq[(i + 1) * dk], dq_out);
    std::copy(&b.dk[i * dk], &b.dk[(i + 1) * dk], dk_out);
    *dg_out = suffix;
    *dgamma_out = suffix / std::exp(s.g[i]);
    *dbeta_out = b.dbeta[i];
  }
}

}  // namespace

template <typename T>
void chunked_head_backward(
    const GatedDeltaParams& p, const BackwardHeadView<T>& h) {
  const int dk = p.key_dim, dv = p.value_dim;
  const bool per_key = p.per_key_gates;
  BackwardScratch b(dk, dv, per_key);
  ChunkStore store(p.num_chunks(), dk, dv, per_key);
  boundary_states(p, h, b.s, store);

  const HeadView<T> view = forward_view(h);
  // dS is carried from the last chunk to the first transposed, in b.ds_t;
  // h.dstate ([Dv, Dk]) holds it untransposed within a chunk.
  float* ds = h.dstate;
  transpose(h.state_cotangent, dv, dk, dk, b.ds_t.data(), dv);
  for (int c = p.num_chunks() - 1; c >= 0; --c) {
    const int start = c * C;
    const int L = std::min(C, p.tokens - start);
    const float* entry_t = &store.entry_t[c * store.state_size];
    transpose(entry_t, dk, dv, dv, b.entry.data(), dk);
    transpose(b.ds_t.data(), dk, dv, dv, ds, dk);
    if (!normal_decays(p, h, start, L)) {
      recurrent_chunk_backward_from_entry(p, h, start, L, b.entry.data(), ds);
      transpose(ds, dv, dk, dk, b.ds_t.data(), dv);
      continue;
    }
    // The forward's cheap stages again; the rest from the store.
    qk_norm(p, view, start, L, b.s);
    if (!per_key) {
      transpose(b.s.k.data(), L, dk, dk, b.s.k_transposed.data(), C);
      chunk_qk(dk, L, b.s);
    }
    gate_cumsum(p, view, start, L, b.s);
    b.k_gram = &store.k_gram[size_t(c) * C * C];
    b.qk = per_key ? &store.qk[size_t(c) * C * C] : nullptr;
    b.inverse = &store.inverse[size_t(c) * C * C];
    b.w = &store.w[c * store.w_size];
    b.corrected = &store.corrected[c * store.v_size];
    load_output_cotangent(p, h, start, L, b);
    std::fill(b.d_log, b.d_log + C, 0.0f);
    std::fill(b.dbeta, b.dbeta + C, 0.0f);

    if (per_key) {
      fill_zero(b.key_d_log);
      key_chunk_output_backward(p, L, b);
      key_chunk_carry_backward(p, L, b, entry_t, ds);
      key_recompute_w_u_backward(p, h, start, L, b);
      key_kkt_inverse_backward(p, L, b);
      key_gate_cumsum_backward(p, h, start, L, b);
    } else {
      chunk_output_backward(p, L, b);
      chunk_carry_backward(p, L, b, entry_t, ds);
      recompute_w_u_backward(p, h, start, L, b);
      kkt_inverse_backward(p, L, b);
      gate_cumsum_backward(p, h, start, L, b);
    }
    std::swap(b.ds_t, b.ds0_t);
  }
  transpose(b.ds_t.data(), dk, dv, dv, ds, dk);
}

template void chunked_head_backward<float>(
    const GatedDeltaParams&, const BackwardHeadView<float>&);
template void chunked_head_backward<mlx::core::float16_t>(
    const GatedDeltaParams&, const BackwardHeadView<mlx::core::float16_t>&);
template void chunked_head_backward<mlx::core::bfloat16_t>(
    const GatedDeltaParams&, const BackwardHeadView<mlx::core::bfloat16_t>&);

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
