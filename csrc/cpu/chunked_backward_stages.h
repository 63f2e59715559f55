// The chunked WY form's backward on the CPU: its scratch, what
// boundary_states keeps of each chunk, and the stages shared by the scalar
// gates (chunked_backward.cpp) and the per-key gates
// (key_chunked_backward.cpp).
#pragma once

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
  // out ([L, Dk]) = R (rows) or C (columns); b and a are [L, Dk] rows.
  void rows(
      const KeyChunkDecays& d,
      int L,
      int dk,
      const float* x,
      const float* b,
      float* out);
  void columns(
      const KeyChunkDecays& d,
      int L,
      int dk,
      const float* x,
      const float* a,
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
        key_d_log(per_key ? kChunkSize * dk : 0),
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
  float d_log[kChunkSize];  // dG
  float dbeta[kChunkSize];
  // Per-key gates only: dG per channel ([L, Dk]); the column side of a
  // decayed product ([L, Dk]); the decayed products' scratch.
  std::vector<float> key_d_log, key_columns;
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
// key_decayed_grams).
struct ChunkStore {
  ChunkStore(int chunks, int dk, int dv, bool per_key)
      : state_size(size_t(dk) * dv),
        w_size(size_t(kChunkSize) * dk),
        v_size(size_t(kChunkSize) * dv),
        entry_t(chunks * state_size),
        k_gram(size_t(chunks) * kChunkSize * kChunkSize),
        qk(per_key ? size_t(chunks) * kChunkSize * kChunkSize : 0),
        inverse(size_t(chunks) * kChunkSize * kChunkSize),
        w(chunks * w_size),
        corrected(chunks * v_size) {}
  size_t state_size, w_size, v_size;
  std::vector<float> entry_t, k_gram, qk, inverse, w, corrected;
};

// Shared by both gates (chunked_backward.cpp):
// The share of V' = U - W S0^T in chunk_carry_backward: dW = -dV' S0 and
// dS0 -= W^T dV' (transposed, into b.ds0_t).
void delta_backward(const GatedDeltaParams& p, int L, BackwardScratch& b);
// recompute_w_u_backward's products, from Vb^T and Kb^T (b.scaled_v_t,
// b.scaled_k_t): dT = dU Vb^T + dW Kb^T (lower), dVb = T^T dU, dKb = T^T dW.
void w_u_products(const GatedDeltaParams& p, int L, BackwardScratch& b);
// kkt_inverse_backward's dA = -T^T dT T^T (lower part valid) into b.da.
void inverse_gradient(int L, BackwardScratch& b);

// The per-key stages (key_chunked_backward.cpp), named as the scalar ones;
// each adds its decay terms to b.key_d_log.
void key_chunk_output_backward(
    const GatedDeltaParams& p, int L, BackwardScratch& b);
void key_chunk_carry_backward(
    const GatedDeltaParams& p,
    int L,
    BackwardScratch& b,
    const float* entry_t,
    const float* ds);
template <typename T>
void key_recompute_w_u_backward(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    int start,
    int L,
    BackwardScratch& b);
void key_kkt_inverse_backward(
    const GatedDeltaParams& p, int L, BackwardScratch& b);
template <typename T>
void key_gate_cumsum_backward(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    int start,
    int L,
    BackwardScratch& b);

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
