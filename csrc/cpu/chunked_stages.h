// The stages of the chunked WY/UT form on the CPU, shared by the forward
// (chunked_forward.cpp) and the chunked backward (chunked_backward.cpp), which
// recomputes W, U and the deltas of each chunk with the same functions.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/kernel_common.h"
#include "cpu/key_chunk_decays.h"
#include "cpu/small_gemm.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

// ---------------------------------------------------------------------------
// Chunked WY/UT form, per chunk of L tokens with entry state S0 ([Dv, Dk]), as
// a pipeline of the stages the Metal kernels and the float64 reference
// (mlx_gated_delta/reference/) name the same way (docs/numerics.md has the
// math and the stage table):
//   qk_norm        q, k rows loaded as float32 (and L2-normalised)
//   gate_cumsum    decay(i, j) = prod_{j < s <= i} exp(g_s)  (j = -1: the
//                  chunk's start); per-key gates: decay(i, j, c) per channel
//   key_decayed_grams  (per-key gates, in place of k_gram and chunk_qk) the
//                  decayed K K^T and Q K^T of one value head
//                  (KeyChunkDecays::decayed_grams)
//   k_gram         K K^T (lower triangle)
//   chunk_qk       Q K^T (lower triangle)
//   kkt_inverse    A_ij = beta_i decay(i, j) k_i.k_j (j < i); T = (I + A)^-1
//   recompute_w_u  U = T diag(beta) V,  W = T diag(beta decay(i,-1)) K
//   chunk_carry    V' = U - W S0^T (the true deltas), the inter-chunk output
//                  decay(i,-1) S0 q_i, and (chunk_carry_state, after
//                  chunk_output) S_end = decay(L-1,-1) S0
//                  + sum_j decay(L-1, j) V'_j k_j^T
//   chunk_output   y_i = scale (inter_i + sum_{j<=i} decay(i,j) q_i.k_j V'_j)
//   chunk_checkpoint  (only with checkpoints) the state after i tokens of the
//                  chunk, decay(i-1,-1) S0 + sum_{j<i} decay(i-1, j) V'_j
//                  k_j^T: chunk_carry's exit state cut at i (at i = L it is
//                  that state)
// Every stage is a product of small matrices (small_gemm.h). The state is held
// transposed ([Dk, Dv]) while a problem runs, so that it is the row-major
// right-hand operand of the products that read and update it.
//
// A decay that underflows to exactly 0 (g = -inf from gamma == 0) is a wipe:
// decay(i, j) is 0 whenever a wipe lies in (j, i], decided by index, never by
// subtracting cumulative logs across it (that would be -inf - -inf = NaN).
// The other decays are decay_exp of the difference of cumulative logs, as with
// per-key gates: the decay matrix takes L (L + 1) / 2 of them a chunk and
// value head, and the library's scalar expf call was 3% of the forward.
class ChunkDecays {
 public:
  void compute(const float* g, const bool* active, int length) {
    length_ = length;
    for (int i = 0; i < length; ++i) {
      const float gi = active[i] ? g[i] : 0.0f;
      const bool wipe = std::exp(gi) == 0.0f;
      const float previous_sum = i ? log_sum_[i - 1] : 0.0f;
      log_sum_[i] = previous_sum + (wipe ? 0.0f : gi);
      last_wipe_[i] = wipe ? i : (i ? last_wipe_[i - 1] : -1);
    }
  }
  // decay(i, j) for -1 <= j <= i.
  float operator()(int i, int j) const {
    if (last_wipe_[i] > j) {
      return 0.0f;
    }
    return decay_exp(log_sum_[i] - (j >= 0 ? log_sum_[j] : 0.0f));
  }
  float from_start(int i) const {
    return (*this)(i, -1);
  }
  float to_end(int j) const {
    return (*this)(length_ - 1, j);
  }
  float log_sum(int i) const {
    return log_sum_[i];
  }
  int last_wipe(int i) const {
    return last_wipe_[i];
  }
  // matrix[i * kChunkSize + j] = decay(i, j) for j <= i, 0 above the diagonal.
  void lower_matrix(float* matrix) const {
    for (int i = 0; i < length_; ++i) {
      float* row = matrix + i * kChunkSize;
      const float log_sum_i = log_sum_[i];
      const int last_wipe = last_wipe_[i];
#pragma omp simd
      for (int j = 0; j <= i; ++j) {
        const float value = decay_exp(log_sum_i - log_sum_[j]);
        row[j] = j < last_wipe ? 0.0f : value;
      }
      for (int j = i + 1; j < length_; ++j) {
        row[j] = 0.0f;
      }
    }
  }

 private:
  int length_ = 0;
  float log_sum_[kChunkSize];
  int last_wipe_[kChunkSize];
};

// Scratch of one task. Row strides: Dk for [L, Dk], Dv for [L, Dv],
// kChunkSize for [L, L] and for the transposed keys [Dk, L]. The first group
// depends only on the key head and is shared by the value heads that read it;
// the rest is one value head's work on one chunk.
struct ChunkScratch {
  ChunkScratch(int dk, int dv)
      : q(kChunkSize * dk),
        k(kChunkSize * dk),
        k_transposed(dk * kChunkSize),
        k_gram(kChunkSize * kChunkSize),
        qk(kChunkSize * kChunkSize),
        scaled_k(kChunkSize * dk),
        w(kChunkSize * dk),
        scaled_v(kChunkSize * dv),
        u(kChunkSize * dv),
        y(kChunkSize * dv),
        decay(kChunkSize * kChunkSize),
        a(kChunkSize * kChunkSize),
        inverse(kChunkSize * kChunkSize),
        qk_decayed(kChunkSize * kChunkSize) {}
  // Shared by the value heads of one key head.
  std::vector<float> q, k, k_transposed, k_gram, qk;
  bool active[kChunkSize];
  // One value head's chunk. u holds U, then V' after chunk_carry; y holds the
  // inter-chunk output, then the whole output row before scaling.
  std::vector<float> scaled_k, w;
  std::vector<float> scaled_v, u, y;
  std::vector<float> decay, a, inverse, qk_decayed;
  float beta[kChunkSize];
  float g[kChunkSize];
  ChunkDecays decays;
  // Per-key gates only: the channel decays, and in k_gram and qk_decayed the
  // decayed grams of one value head (k_gram and qk stay unused).
  KeyChunkDecays key_decays;
};

inline void fill_zero(std::vector<float>& values) {
  std::fill(values.begin(), values.end(), 0.0f);
}

// out[c, r] = in[r, c] for `rows` x `cols`, in tiles of 16 x 16. Element by
// element along whole rows, each store of a 128 x 128 state lands 512 bytes
// past the last, and the loop ran at about 1 ns an element; a tile's 16 rows
// and 16 columns stay in L1 (2.4x faster on that state).
inline void transpose(
    const float* in,
    int rows,
    int cols,
    int64_t ld_in,
    float* out,
    int64_t ld_out) {
  constexpr int kTile = 16;
  for (int r0 = 0; r0 < rows; r0 += kTile) {
    const int r1 = std::min(rows, r0 + kTile);
    for (int c0 = 0; c0 < cols; c0 += kTile) {
      const int c1 = std::min(cols, c0 + kTile);
      for (int c = c0; c < c1; ++c) {
        for (int r = r0; r < r1; ++r) {
          out[c * ld_out + r] = in[r * ld_in + c];
        }
      }
    }
  }
}

// The stages, in pipeline order (chunked_forward.cpp has each one's comment).
template <typename T>
void qk_norm(
    const GatedDeltaParams& p,
    const HeadView<T>& h,
    int start,
    int L,
    ChunkScratch& s);
void k_gram(int dk, int L, ChunkScratch& s);
void chunk_qk(int dk, int L, ChunkScratch& s);
template <typename T>
void gate_cumsum(
    const GatedDeltaParams& p,
    const HeadView<T>& h,
    int start,
    int L,
    ChunkScratch& s);
void key_decayed_grams(ChunkScratch& s);
void kkt_inverse(const GatedDeltaParams& p, int L, ChunkScratch& s);
template <typename T>
void recompute_w_u(
    const GatedDeltaParams& p,
    const HeadView<T>& h,
    int start,
    int L,
    ChunkScratch& s);
void chunk_carry(
    const GatedDeltaParams& p, int L, ChunkScratch& s, const float* state_t);
void chunk_carry_state(
    const GatedDeltaParams& p, int L, ChunkScratch& s, float* state_t);

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
