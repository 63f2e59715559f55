// The stages of the chunked WY/UT form on the CPU, shared by the forward
// (chunked_forward.cpp) and the chunked backward (chunked_backward.cpp), which
// recomputes W, U and the deltas of each chunk with the same functions.
#pragma once

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/kernel_common.h"
#include "cpu/small_gemm.h"

namespace mlx_gated_delta::cpu {

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
    return std::exp(log_sum_[i] - (j >= 0 ? log_sum_[j] : 0.0f));
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
        const float value = std::exp(log_sum_i - log_sum_[j]);
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

// exp(x) of a log decay, in float32 arithmetic that vectorises: the
// per-key stages form Dk factors per row, and the library's expf is a scalar
// call here (glibc has vector versions under -ffast-math only). x = n ln 2 + r
// with |r| <= ln(2) / 2, ln 2 split so that n ln2_high is exact; exp(r) by
// its Taylor polynomial to r^7 (truncation r^8 / 8! < 6e-9, below float32's
// rounding); times 2^n through the exponent bits. Within a few ulp of exp down
// to exp(-87), 0 below (a decay under 1.7e-38 weighs less than float32
// keeps of any term it multiplies), inf above exp(88).
inline float decay_exp(float x) {
  constexpr float kLog2e = 1.44269504f;
  constexpr float kLn2High = 0.693359375f;  // 355 / 512
  constexpr float kLn2Low = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds
  constexpr float kLowest = -87.0f, kHighest = 88.0f;
  const float clamped = std::min(std::max(x, kLowest), kHighest);
  const float n = (clamped * kLog2e + kRound) - kRound;
  const float r =
      multiply_add(-n, kLn2Low, multiply_add(-n, kLn2High, clamped));
  float p = 1.0f / 5040.0f;
  p = multiply_add(p, r, 1.0f / 720.0f);
  p = multiply_add(p, r, 1.0f / 120.0f);
  p = multiply_add(p, r, 1.0f / 24.0f);
  p = multiply_add(p, r, 1.0f / 6.0f);
  p = multiply_add(p, r, 0.5f);
  p = multiply_add(p, r, 1.0f);
  p = multiply_add(p, r, 1.0f);
  const int32_t exponent_bits = (int32_t(n) + 127) << 23;
  float two_to_n;
  std::memcpy(&two_to_n, &exponent_bits, sizeof(two_to_n));
  const float value = p * two_to_n;
  return x < kLowest
      ? 0.0f
      : (x > kHighest ? std::numeric_limits<float>::infinity() : value);
}

// Per-key gates: the same decays per key channel c, decay(i, j, c) =
// exp(G_ic - G_jc) over the channel's finite g, 0 if a wipe of channel c lies
// in (j, i]. No factor is formed as a ratio exp(G_i) / exp(G_j) of two factors
// from the chunk's start: -G_j reaches +12800 for a channel at g = -200 over
// 64 tokens, and exp of it is inf (docs/numerics.md).
//
// The decayed grams run as matrix products in sub-chunks of kSubChunkSize
// rows (decayed_grams). Each factor's exponent is a sum of the g over one
// interval; from_start and to_end are the chunk's interval factors that W,
// the inter-chunk output and the carry read, formed once per value head.
constexpr int kSubChunkSize = 16;

// The diagonal block of a sub-chunk runs as a product too for every channel
// whose log decay G moves by at most this much across the sub-chunk, from
// its first row p: its factors exp(G_ic - G_pc) and exp(G_pc - G_jc) lie in
// [exp(-80), exp(80)] = [1.8e-35, 5.5e34], so each term q_ic k_jc
// exp(G_ic - G_jc) (p <= j <= i) is formed to a few float32 roundings of
// itself. (Where |q_ic| < 1e-3 the row factor can be subnormal: the term's
// error is then at most 2^-150 exp(80) |k_jc| = 4e-11 |k_jc|.) The entries the
// product forms above the diagonal are discarded. KDA's gate with
// lower_bound = -5 moves G by at most 75 over the 15 steps of a sub-chunk, so
// such layers take this form for every channel; a channel beyond the limit,
// or with a wipe inside the sub-chunk, takes the diagonal block pair by pair.
// Nothing requires a bound.
constexpr float kProductLogLimit = 80.0f;

class KeyChunkDecays {
 public:
  // g: token 0, channel 0 of the chunk; the active tokens' g (0 elsewhere).
  void compute(
      const float* g,
      int64_t token_stride,
      const bool* active,
      int length,
      int dk);
  // decay(i, j, c) for -1 <= j <= i.
  float operator()(int i, int j, int c) const {
    const size_t e = size_t(i) * dk_ + c;
    if (last_wipe_[e] > j) {
      return 0.0f;
    }
    return decay_exp(
        log_sum_[e] - (j >= 0 ? log_sum_[size_t(j) * dk_ + c] : 0.0f));
  }
  // [L, Dk]: decay(i, -1, c) and decay(L-1, j, c).
  const float* from_start() const {
    return from_start_.data();
  }
  const float* to_end() const {
    return to_end_.data();
  }
  float log_sum(int i, int c) const {
    return log_sum_[size_t(i) * dk_ + c];
  }
  int last_wipe(int i, int c) const {
    return last_wipe_[size_t(i) * dk_ + c];
  }
  // The decayed grams of the chunk, for j <= i (0 above the diagonal):
  //   k_gram[i, j] = sum_c k_ic k_jc decay(i, j, c)   (j < i; the diagonal 0)
  //   qk[i, j]     = sum_c q_ic k_jc decay(i, j, c)
  // q, k: [L, Dk] rows; k_transposed: [Dk, kChunkSize].
  void decayed_grams(
      const float* q,
      const float* k,
      const float* k_transposed,
      float* k_gram,
      float* qk);

 private:
  // Adds the pair-by-pair terms of the channels `channels` to the diagonal
  // block of the sub-chunk starting at row `first` (n rows).
  void diagonal_pairs(
      const float* q,
      const float* k,
      int first,
      int n,
      const std::vector<int>& channels,
      float* k_gram,
      float* qk) const;

  int length_ = 0;
  int dk_ = 0;
  std::vector<float> log_sum_;  // [L, Dk]
  std::vector<int> last_wipe_;  // [L, Dk]
  std::vector<float> entry_sums_;  // [Dk] zeros
  std::vector<int> entry_wipes_;  // [Dk] -1
  // Channel-major copy [Dk, kChunkSize], read along the tokens.
  std::vector<float> log_sum_t_;
  std::vector<float> from_start_, to_end_;  // [L, Dk]
  // decayed_grams' operands: one sub-chunk's rows relative to its first row
  // ([kSubChunkSize, Dk]) and the columns up to its end relative to the same
  // row ([Dk, kChunkSize]).
  std::vector<float> q_rows_, k_rows_, columns_;
  std::vector<int> pair_channels_;
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

inline void transpose(
    const float* in,
    int rows,
    int cols,
    int64_t ld_in,
    float* out,
    int64_t ld_out) {
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      out[c * ld_out + r] = in[r * ld_in + c];
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

}  // namespace mlx_gated_delta::cpu
