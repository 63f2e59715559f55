// The chunked WY form's backward on the CPU: its scratch, what
// boundary_states keeps of each chunk, and its stages, each written once
// over the decay kind `Gates`: one decay per row (ScalarGates,
// chunked_backward.cpp) or per row and key channel (PerKeyGates,
// key_chunked_backward.cpp, whose comment says what changes).
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
//   gate_cumsum_backward    every decay is decay(i, j) = prod_{j < s <= i}
//                           gamma_s, gamma = exp(g), and the stages above
//                           leave each one's gradient P_ij without it, so
//                           dgamma_t = sum_{i >= t > j} P_ij decay(i, t)
//                           decay(t-1, j) (decay_gradient); dg_t = gamma_t
//                           dgamma_t
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
// formed: Gamma_i's gradient is (dO_i S0) . q_i, from the product that dq
// needs anyway. A chunk in which some decay is not a normal float (a wipe,
// gamma == 0, or a subnormal decay) runs the recurrent form's reverse
// instead, which gives the gradient of a wipe exactly.
// Masked tokens get exactly zero gradients, written as such.
//
// A decay kind provides, as static functions, what differs between the two:
//   from_start(s, i, dk), to_end(s, j, dk)  row i's Gamma_i and row j's e_j,
//                           one factor per channel (operator[])
//   forward_grams, reverse_grams  the grams of a chunk after gate_cumsum:
//                           boundary_states' (kept in the store) and the
//                           reverse's (chunk_qk again, or the kept ones)
//   output_matrix, output_products  chunk_output_backward's M, and dq, dk
//                           from dM (kept in b.dm)
//   entry_backward, exit_backward  chunk_carry_backward's scaled shares: of
//                           the entry state (from P = dO S0, returning the
//                           operands of dS0 += (Q o Gamma)^T dO; Gamma's
//                           gradients into b.entry_terms) and of the exit
//                           state's keys (from V' dS; e's into b.exit_terms)
//   scaled_key_backward     recompute_w_u_backward's Kb row i: dk and
//                           Gamma_i's gradient; returns its share of dbeta_i
//   inverse_backward        kkt_inverse_backward from dA: dk and dbeta,
//                           keeping diag(beta) dA in b.da
//   pair_term(b, i, j, dk)  the gradient of decay(i, j) (j < i) in M and
//                           A without it, per channel (operator[])
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "cpu/backward_head_view.h"
#include "cpu/chunked_stages.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

// Per-key gates: the products of a lower [L, L] matrix X (row stride
// kChunkSize, 0 above its diagonal) decayed per key channel,
//   rows:     R_ic = sum_{j <= i} X_ij decay(i, j, c) b_jc
//   columns:  C_jc = sum_{i >= j} X_ij decay(i, j, c) a_ic
// in sub-chunks of kSubChunkSize rows as matrix products whose factors are
// at most 1 (key_chunked_backward.cpp). Only for chunks without a wipe.
class KeyDecayedProducts {
 public:
  explicit KeyDecayedProducts(int dk)
      : operand_(size_t(kChunkSize) * dk),
        block_(size_t(kSubChunkSize) * dk),
        product_(dk) {}
  // out ([L, Dk]) = R (rows, `operand` = b) or C (columns, `operand` = a);
  // the operand is [L, Dk] rows.
  template <bool kColumns>
  void product(
      const KeyChunkDecays& d,
      int L,
      int dk,
      const float* x,
      const float* operand,
      float* out);

 private:
  std::vector<float> operand_;  // [L, Dk]: one side's rows, decayed
  std::vector<float> block_;  // [kSubChunkSize, Dk]: a diagonal block's product
  // Per channel of a diagonal block: 1 where it runs as a product, else 0
  // (those channels, listed in pair_channels_, run pair by pair).
  std::vector<float> product_;
  std::vector<int> pair_channels_;
};

// The backward's own scratch, beside the forward's ChunkScratch. Row strides
// as there: Dk for [L, Dk], Dv for [L, Dv], C for [L, L] and for transposed
// rows ([Dk, L], [Dv, L]).
struct BackwardScratch {
  BackwardScratch(int dk, int dv, bool per_key)
      : s(dk, dv),
        entry(size_t(dv) * dk),
        ds_t(size_t(dk) * dv),
        ds0_t(size_t(dk) * dv),
        d_out(kChunkSize * dv),
        scaled_d_out(kChunkSize * dv),
        d_corrected(kChunkSize * dv),
        out_state(kChunkSize * dk),
        corrected_t(size_t(dv) * kChunkSize),
        m(kChunkSize * kChunkSize),
        dm(kChunkSize * kChunkSize),
        dq(kChunkSize * dk),
        dk(kChunkSize * dk),
        dw(kChunkSize * dk),
        end_keys(kChunkSize * dk),
        row_tmp(kChunkSize * dk),
        dt(kChunkSize * kChunkSize),
        scaled_v_t(size_t(dv) * kChunkSize),
        scaled_k_t(size_t(dk) * kChunkSize),
        d_scaled_v(kChunkSize * dv),
        d_scaled_k(kChunkSize * dk),
        inverse_t(kChunkSize * kChunkSize),
        x(kChunkSize * kChunkSize),
        da(kChunkSize * kChunkSize),
        v_rows(kChunkSize * dv),
        entry_terms(kChunkSize * (per_key ? dk : 1)),
        exit_terms(kChunkSize * (per_key ? dk : 1)),
        gammas(kChunkSize * (per_key ? dk : 1)),
        carried(kChunkSize * (per_key ? dk : 1)),
        d_decay(kChunkSize * (per_key ? dk : 1)),
        running(per_key ? dk : 1),
        key_columns(per_key ? kChunkSize * dk : 0),
        products(per_key ? dk : 0) {}
  ChunkScratch s;  // the forward's stages' outputs for this chunk
  std::vector<float> entry;  // S0, [Dv, Dk]
  std::vector<float> ds_t, ds0_t;  // dS (exit) and dS0, transposed [Dk, Dv]
  std::vector<float> d_out, scaled_d_out;  // dO and diag(Gamma) dO
  std::vector<float> d_corrected, corrected_t;  // dV' = dU; V'^T
  std::vector<float> out_state;  // dO S0
  std::vector<float> m, dm;  // M; dM, then dMd
  std::vector<float> dq, dk;  // this value head's dq, dk of the chunk
  std::vector<float> dw, end_keys, row_tmp;  // dW; diag(e) K; V' dS
  std::vector<float> dt, scaled_v_t, scaled_k_t;  // dT; Vb^T; Kb^T
  std::vector<float> d_scaled_v, d_scaled_k;  // dVb, dKb
  std::vector<float> inverse_t, x, da;  // T^T; dT T^T; dA, then dA o beta decay
  std::vector<float> v_rows;  // the chunk's v, float32
  // The gradients of the decays the products read, without the decays
  // ([L], or per key channel [L, Dk]): of decay(i, -1), from the chunk's
  // start, at row i (entry_terms), and of decay(L-1, j), to its end, at row
  // j (exit_terms); gate_cumsum_backward's exp(g), carried sums h_t and
  // gradient of the decays, and its running decay ([1] or [Dk]).
  std::vector<float> entry_terms, exit_terms;
  std::vector<float> gammas, carried, d_decay, running;
  float dbeta[kChunkSize];
  // Per-key gates only: the column side of a decayed product ([L, Dk]); the
  // decayed products' scratch.
  std::vector<float> key_columns;
  KeyDecayedProducts products;
  // This chunk's slices of the ChunkStore.
  const float* k_gram = nullptr;
  const float* qk = nullptr;  // per-key gates: the decayed Q K^T
  const float* inverse = nullptr;
  const float* w = nullptr;
  const float* corrected = nullptr;
};

// What boundary_states keeps of each chunk for the reverse: the entry state
// (transposed, [Dk, Dv]), K K^T and T ([L, L], row stride C), W ([L, Dk])
// and V' ([L, Dv]); per-key gates: K K^T and Q K^T decayed (per value head,
// key_decayed_grams). Left uninitialised: boundary_states writes every slot
// before the reverse reads it, and zeroing a problem's store (5 MiB at
// T = 2048, Dk = Dv = 128) took 3% of the backward. One block, not one per
// array: glibc (mallopt(3)) raises its mmap threshold to the largest block
// freed so far, and keeps freed memory at the top of the heap only up to
// twice that. Six arrays of 2-8 MiB (20 MiB at T = 8192) went back to the
// system after every problem and came back as fresh pages: 224,000 page
// faults a call of the backward, against 54,000 (the outputs') as one block.
struct ChunkStore {
  ChunkStore(int chunks, int dk, int dv, bool per_key)
      : state_size(size_t(dk) * dv),
        w_size(size_t(kChunkSize) * dk),
        v_size(size_t(kChunkSize) * dv),
        gram_size(size_t(kChunkSize) * kChunkSize),
        block(new float
                  [chunks *
                   (state_size + (per_key ? 3 : 2) * gram_size + w_size +
                    v_size)]),
        entry_t(block.get()),
        k_gram(entry_t + chunks * state_size),
        inverse(k_gram + chunks * gram_size),
        w(inverse + chunks * gram_size),
        corrected(w + chunks * w_size),
        qk(per_key ? corrected + chunks * v_size : nullptr) {}
  size_t state_size, w_size, v_size, gram_size;
  std::unique_ptr<float[]> block;
  float *entry_t, *k_gram, *inverse, *w, *corrected, *qk;
};

// What chunk_carry_backward's product dS0 += (Q o Gamma)^T dO reads: one
// factor scaled by the decays from the chunk's start, Q's channels
// (`keys`, per-key gates) or dO's rows (`rows`, scalar gates).
struct EntryOperands {
  const float* keys;
  const float* rows;
};

// The chunked backward of one problem with per-key gates
// (key_chunked_backward.cpp).
template <typename T>
void key_chunked_head_backward(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    ChunkedBackwardTrace* trace);

namespace chunked_backward {

constexpr int C = kChunkSize;

// Shared by both kinds (chunked_backward.cpp):
// The share of V' = U - W S0^T in chunk_carry_backward: dW = -dV' S0 and
// dS0 -= W^T dV' (transposed, into b.ds0_t).
void delta_backward(const GatedDeltaParams& p, int L, BackwardScratch& b);
// recompute_w_u_backward's products, from Vb^T and Kb^T (b.scaled_v_t,
// b.scaled_k_t): dT = dU Vb^T + dW Kb^T (lower), dVb = T^T dU, dKb = T^T dW.
void w_u_products(const GatedDeltaParams& p, int L, BackwardScratch& b);
// kkt_inverse_backward's dA = -T^T dT T^T (lower part valid) into b.da.
void inverse_gradient(int L, BackwardScratch& b);

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

// Asks for this chunk's v rows (recompute_w_u and its backward read them
// after the grams) and for the q, k and per-key gate rows of the chunk at
// `next` (the one walked next, if any) to be brought into the cache: their
// rows lie a token apart (prefetch_rows).
template <typename T>
void prefetch_chunk_rows(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    int start,
    int L,
    int next) {
  prefetch_rows(
      h.v + start * h.v_token_stride, L, h.v_token_stride, p.value_dim);
  if (next < 0 || next >= p.tokens) {
    return;
  }
  const int next_L = std::min(C, p.tokens - next);
  const int64_t qk = int64_t(next) * h.qk_token_stride;
  prefetch_rows(h.q + qk, next_L, h.qk_token_stride, p.key_dim);
  prefetch_rows(h.k + qk, next_L, h.qk_token_stride, p.key_dim);
  if (p.per_key_gates) {
    prefetch_rows(
        h.g + next * h.g_token_stride, next_L, h.g_token_stride, p.key_dim);
  }
}

// boundary_states: the forward's stages over the chunks, keeping what
// ChunkStore holds (per-key gates: key_decayed_grams in place of k_gram).
template <typename Gates, typename T>
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
    gate_cumsum(p, view, start, L, s);
    prefetch_chunk_rows(p, h, start, L, start + C);
    Gates::forward_grams(dk, L, s, store, c);
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

// chunk_output_backward: dV' = M^T dO, dM = dO V'^T (kept for the decays'
// gradients); then dq = R(dM, K), dk = C(dM, Q), the products through the
// decays.
template <typename Gates>
void chunk_output_backward(
    const GatedDeltaParams& p, int L, BackwardScratch& b) {
  const int dv = p.value_dim;
  const float* m = Gates::output_matrix(L, b);
  gemm(
      L,
      dv,
      L,
      1.0f,
      {m, 1, C},
      b.d_out.data(),
      dv,
      b.d_corrected.data(),
      dv,
      Triangle::UpperA,
      Output::Overwrite);
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
  Gates::output_products(p, L, b);
}

// chunk_carry_backward: the entry state's share of the output and of the
// exit state, and V' = U - W S0^T. Reads dS (b.ds_t) and the entry state
// (b.entry; `entry_t` transposed), writes dS0 (b.ds0_t), dU (in
// b.d_corrected) and dW.
template <typename Gates>
void chunk_carry_backward(
    const GatedDeltaParams& p,
    int L,
    BackwardScratch& b,
    const float* entry_t,
    const float* ds) {
  const int dk = p.key_dim, dv = p.value_dim;
  const ChunkScratch& s = b.s;
  // The inter-chunk output (Q o Gamma) S0^T, through P = dO S0.
  gemm(
      L,
      dk,
      dv,
      1.0f,
      {b.d_out.data(), dv, 1},
      b.entry.data(),
      dk,
      b.out_state.data(),
      dk,
      Triangle::None,
      Output::Overwrite);
  const EntryOperands entry = Gates::entry_backward(p, L, b, entry_t);
  gemm(
      dk, dv, L, 1.0f, {entry.keys, 1, dk}, entry.rows, dv, b.ds0_t.data(), dv);

  // The exit state's sum V'^T (e o K).
  for (int j = 0; j < L; ++j) {
    const auto e = Gates::to_end(s, j, dk);
    for (int c = 0; c < dk; ++c) {
      b.end_keys[j * dk + c] = e[c] * s.k[j * dk + c];
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
  gemm(
      L,
      dk,
      dv,
      1.0f,
      {b.corrected, dv, 1},
      ds,
      dk,
      b.row_tmp.data(),
      dk,
      Triangle::None,
      Output::Overwrite);
  Gates::exit_backward(p, L, b);

  delta_backward(p, L, b);
}

// recompute_w_u_backward: dT = dU Vb^T + dW Kb^T (lower), dVb = T^T dU,
// dKb = T^T dW; then dv = beta dVb, and Vb's and Kb's shares of dk, dbeta and
// the gate.
template <typename Gates, typename T>
void recompute_w_u_backward(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    int start,
    int L,
    BackwardScratch& b) {
  const int dk = p.key_dim, dv = p.value_dim;
  const ChunkScratch& s = b.s;
  // Vb^T and Kb^T, built transposed from the rows (0 where masked: beta 0).
  for (int i = 0; i < L; ++i) {
    float* v_row = &b.v_rows[i * dv];
    load_vector(h.v + (start + i) * h.v_token_stride, v_row, dv);
    for (int c = 0; c < dv; ++c) {
      b.scaled_v_t[c * C + i] = s.beta[i] * v_row[c];
    }
    const auto decay_from_start = Gates::from_start(s, i, dk);
    for (int c = 0; c < dk; ++c) {
      b.scaled_k_t[c * C + i] =
          s.beta[i] * decay_from_start[c] * s.k[i * dk + c];
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
    const float key_dbeta = Gates::scaled_key_backward(p, i, b);
    b.dbeta[i] += dot(d_scaled_v, &b.v_rows[i * dv], dv) + key_dbeta;
  }
}

// kkt_inverse_backward: dA = -T^T dT T^T on the strictly lower triangle,
// then A's shares of dk, dbeta and the gate.
template <typename Gates>
void kkt_inverse_backward(
    const GatedDeltaParams& p, int L, BackwardScratch& b) {
  inverse_gradient(L, b);
  Gates::inverse_backward(p, L, b);
}

// gate_cumsum_backward's gradient of the decays, b.d_decay = dgamma. Every
// decay the stages read is decay(i, j) = prod_{j < s <= i} gamma_s (j = -1:
// from the chunk's start), and they left its gradient without it, P_ij:
// Gates::pair_term (j < i), b.entry_terms (j = -1) and b.exit_terms
// (i = L - 1). So dgamma_t = sum_{i >= t > j} P_ij decay(i, t) decay(t-1, j):
// every term is formed without gamma_t and passes token t. (Summing dG_i over
// i >= t instead, as dg, adds and subtracts the terms that do not pass t:
// where gamma_t is tiny, their rounding is far larger than dg, and dg / gamma_t
// would divide it by gamma_t.) With h_t[i] = sum_{j < t} P_ij decay(t-1, j),
//   dgamma_t = sum_{i >= t} decay(i, t) h_t[i],  h_{t+1}[i] = gamma_t h_t[i]
//   + P_it,  h_0[i] = P_{i,-1},
// decay(i, t) as a running product over i: O(L^2) per channel, no exp.
template <typename Gates>
void decay_gradient(const GatedDeltaParams& p, int L, BackwardScratch& b) {
  const int dk = p.key_dim, width = p.gate_width();
  float* carried = b.carried.data();
  float* running = b.running.data();
  std::copy(b.entry_terms.begin(), b.entry_terms.end(), carried);
  for (int t = 0; t < L; ++t) {
    const float* gamma_t = &b.gammas[size_t(t) * width];
    float* d_decay = &b.d_decay[size_t(t) * width];
    std::copy(carried + t * width, carried + (t + 1) * width, d_decay);
    std::fill(running, running + width, 1.0f);
    for (int i = t + 1; i < L; ++i) {
      const float* gamma_i = &b.gammas[size_t(i) * width];
      float* carried_i = carried + size_t(i) * width;
      const auto pair = Gates::pair_term(b, i, t, dk);
#pragma omp simd
      for (int c = 0; c < width; ++c) {
        running[c] *= gamma_i[c];
        d_decay[c] += running[c] * carried_i[c];
        carried_i[c] = gamma_t[c] * carried_i[c] + pair[c];
      }
    }
    if (t + 1 < L) {  // the exit state's decay(L-1, t)
      float* carried_last = carried + size_t(L - 1) * width;
      const float* exit = &b.exit_terms[size_t(t) * width];
      for (int c = 0; c < width; ++c) {
        carried_last[c] += exit[c];
      }
    }
  }
}

// gate_cumsum_backward: dgamma (decay_gradient) and dg = gamma dgamma, per
// channel with per-key gates; then the chunk's rows of every per-token
// gradient but dv (recompute_w_u_backward wrote it), 0 where masked.
template <typename Gates, typename T>
void gate_cumsum_backward(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    int start,
    int L,
    BackwardScratch& b) {
  const int dk = p.key_dim, width = p.gate_width();
  const ChunkScratch& s = b.s;
  // gamma = exp(g), 1 on masked tokens as gate_cumsum takes them; decay_exp
  // is 0 below exp(-87), where a factor weighs less than float32 keeps of
  // the terms it multiplies.
  for (int i = 0; i < L; ++i) {
    float* gamma = &b.gammas[size_t(i) * width];
    const float* g = h.g + (start + i) * h.g_token_stride;
    const bool active = s.active[i];
#pragma omp simd
    for (int c = 0; c < width; ++c) {
      gamma[c] = active ? decay_exp(g[c]) : 1.0f;
    }
  }
  decay_gradient<Gates>(p, L, b);
  for (int i = 0; i < L; ++i) {
    const int t = start + i;
    float* dq_out = h.dq_head + t * h.head_grad_token_stride;
    float* dk_out = h.dk_head + t * h.head_grad_token_stride;
    float* dg_out = h.dg + t * h.g_token_stride;
    float* dgamma_out = h.dgamma + t * h.g_token_stride;
    float* dbeta_out = h.dbeta + t * h.gate_token_stride;
    if (!s.active[i]) {
      std::fill(dq_out, dq_out + dk, 0.0f);
      std::fill(dk_out, dk_out + dk, 0.0f);
      std::fill(dg_out, dg_out + width, 0.0f);
      std::fill(dgamma_out, dgamma_out + width, 0.0f);
      *dbeta_out = 0.0f;
      continue;
    }
    std::copy(&b.dq[i * dk], &b.dq[(i + 1) * dk], dq_out);
    std::copy(&b.dk[i * dk], &b.dk[(i + 1) * dk], dk_out);
    const float* gamma = &b.gammas[size_t(i) * width];
    const float* d_decay = &b.d_decay[size_t(i) * width];
    for (int c = 0; c < width; ++c) {
      dgamma_out[c] = d_decay[c];
      dg_out[c] = gamma[c] * d_decay[c];
    }
    *dbeta_out = b.dbeta[i];
  }
}

// Copies a chunk's L rows of `width` floats (`stride` apart) into slot
// `chunk` of a trace array [chunks, kChunkSize, width].
inline void trace_rows(
    std::vector<float>& out,
    int chunks,
    int chunk,
    const float* rows,
    int L,
    int width,
    int64_t stride) {
  out.resize(size_t(chunks) * C * width);
  float* slot = &out[size_t(chunk) * C * width];
  for (int i = 0; i < L; ++i) {
    std::copy(rows + i * stride, rows + i * stride + width, slot + i * width);
  }
}

// The chunked backward of one problem with the gates' decay kind; with a
// trace, what each stage leaves (ChunkedBackwardTrace).
template <typename Gates, typename T>
void head_backward(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    ChunkedBackwardTrace* trace) {
  const int dk = p.key_dim, dv = p.value_dim;
  if (trace) {
    trace->chunks = p.num_chunks();
  }
  const bool per_key = p.per_key_gates;
  BackwardScratch b(dk, dv, per_key);
  ChunkStore store(p.num_chunks(), dk, dv, per_key);
  boundary_states<Gates>(p, h, b.s, store);

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
    gate_cumsum(p, view, start, L, b.s);
    prefetch_chunk_rows(p, h, start, L, start - C);
    prefetch_rows(h.dy + start * h.v_token_stride, L, h.v_token_stride, dv);
    Gates::reverse_grams(dk, L, b, store, c);
    b.k_gram = &store.k_gram[size_t(c) * C * C];
    b.inverse = &store.inverse[size_t(c) * C * C];
    b.w = &store.w[c * store.w_size];
    b.corrected = &store.corrected[c * store.v_size];
    load_output_cotangent(p, h, start, L, b);
    fill_zero(b.entry_terms);
    std::fill(b.dbeta, b.dbeta + C, 0.0f);

    auto keep = [&](std::vector<float>& out,
                    const float* rows,
                    int width,
                    int64_t stride) {
      trace_rows(out, p.num_chunks(), c, rows, L, width, stride);
    };
    chunk_output_backward<Gates>(p, L, b);
    if (trace) {
      keep(trace->output_d_corrected, b.d_corrected.data(), dv, dv);
      keep(trace->output_dq, b.dq.data(), dk, dk);
      keep(trace->output_dk, b.dk.data(), dk, dk);
    }
    chunk_carry_backward<Gates>(p, L, b, entry_t, ds);
    if (trace) {
      keep(trace->carry_d_corrected, b.d_corrected.data(), dv, dv);
      keep(trace->carry_dw, b.dw.data(), dk, dk);
      keep(trace->carry_dq, b.dq.data(), dk, dk);
      keep(trace->carry_dk, b.dk.data(), dk, dk);
    }
    recompute_w_u_backward<Gates>(p, h, start, L, b);
    if (trace) {
      keep(trace->w_u_dt, b.dt.data(), C, C);
      keep(trace->w_u_dk, b.dk.data(), dk, dk);
      keep(trace->w_u_dbeta, b.dbeta, 1, 1);
    }
    kkt_inverse_backward<Gates>(p, L, b);
    if (trace) {
      keep(trace->kkt_dk, b.dk.data(), dk, dk);
      keep(trace->kkt_dbeta, b.dbeta, 1, 1);
    }
    gate_cumsum_backward<Gates>(p, h, start, L, b);
    if (trace) {
      const int width = p.gate_width();
      keep(trace->dg, h.dg + start * h.g_token_stride, width, h.g_token_stride);
    }
    std::swap(b.ds_t, b.ds0_t);
  }
  transpose(b.ds_t.data(), dk, dv, dv, ds, dk);
}

}  // namespace chunked_backward

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
