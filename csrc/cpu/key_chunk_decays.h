// Per-key-channel gates in the chunked form on the CPU: the decays of one
// chunk and value head per key channel, and the decayed grams built from them
// as matrix products of sub-chunks (docs/numerics.md, "Per-key-channel gates
// in the chunked form"). Used by the stages in chunked_forward.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/kernel_common.h"
#include "cpu/small_gemm.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

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
  // [L, Dk]: the cumulative log decays, G_ic.
  const float* log_sums() const {
    return log_sum_.data();
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

inline void KeyChunkDecays::compute(
    const float* g,
    int64_t token_stride,
    const bool* active,
    int length,
    int dk) {
  constexpr int C = kChunkSize;
  length_ = length;
  dk_ = dk;
  const size_t size = size_t(C) * dk;
  for (auto* values : {&log_sum_, &log_sum_t_, &from_start_, &to_end_}) {
    values->resize(size);
  }
  last_wipe_.resize(size);
  // Row -1: the chunk's entry, no decay and no wipe.
  entry_sums_.assign(dk, 0.0f);
  entry_wipes_.assign(dk, -1);
  // The chunk's g rows first, as one copy loop: the rows lie a token's
  // gates apart (Hv Dk floats), and a copy keeps many of their loads in
  // flight, where the sums would wait on each row. A masked token's g is 0.
  for (int i = 0; i < length; ++i) {
    float* row = &log_sum_[size_t(i) * dk];
    if (active[i]) {
      std::copy(g + i * token_stride, g + i * token_stride + dk, row);
    } else {
      std::fill(row, row + dk, 0.0f);
    }
  }
  // Then the sums in place. exp(g) > 0 for g >= -100 (exp(-100) = 3.7e-44,
  // a subnormal): a row without a lower g has no wipe and runs vectorised; a
  // row with one asks expf channel by channel.
  for (int i = 0; i < length; ++i) {
    float* sum_i = &log_sum_[size_t(i) * dk];
    int* wipe_i = &last_wipe_[size_t(i) * dk];
    const float* previous_sum = i ? sum_i - dk : entry_sums_.data();
    const int* previous_wipe = i ? wipe_i - dk : entry_wipes_.data();
    // An integer or-reduction, which vectorises: GCC left a float min
    // reduction here as a chain of scalar minss (a quarter of compute's time).
    int below = 0;
#pragma omp simd reduction(| : below)
    for (int c = 0; c < dk; ++c) {
      below |= sum_i[c] < -100.0f;
    }
    if (!below) {
#pragma omp simd
      for (int c = 0; c < dk; ++c) {
        sum_i[c] = previous_sum[c] + sum_i[c];
        wipe_i[c] = previous_wipe[c];
      }
      continue;
    }
    for (int c = 0; c < dk; ++c) {
      const float gi = sum_i[c];
      const bool wipe = std::exp(gi) == 0.0f;
      sum_i[c] = previous_sum[c] + (wipe ? 0.0f : gi);
      wipe_i[c] = wipe ? i : previous_wipe[c];
    }
  }
  for (int c = 0; c < dk; ++c) {
    for (int i = 0; i < length; ++i) {
      log_sum_t_[size_t(c) * C + i] = log_sum_[size_t(i) * dk + c];
    }
  }
  const float* last_sum = &log_sum_[size_t(length - 1) * dk];
  const int* last_wipe = &last_wipe_[size_t(length - 1) * dk];
  for (int i = 0; i < length; ++i) {
    const float* sum_i = &log_sum_[size_t(i) * dk];
    const int* wipe_i = &last_wipe_[size_t(i) * dk];
    float* from_start = &from_start_[size_t(i) * dk];
    float* to_end = &to_end_[size_t(i) * dk];
#pragma omp simd
    for (int c = 0; c < dk; ++c) {
      const float start_decay = decay_exp(sum_i[c]);
      from_start[c] = wipe_i[c] >= 0 ? 0.0f : start_decay;
      const float end_decay = decay_exp(last_sum[c] - sum_i[c]);
      to_end[c] = last_wipe[c] > i ? 0.0f : end_decay;
    }
  }
}

// Per sub-chunk of rows [first, end) with reference row p = first, for
// j < end: decay(i, j, c) = decay(i, p, c) decay(p, j, c) when j < p, both
// factors at most 1 (a wipe in (j, i] lies in one of the two intervals and
// zeroes that factor); on the diagonal block (p <= j <= i) the product
// channels take exp(G_ic - G_pc) exp(G_pc - G_jc) (kProductLogLimit). So the
// sub-chunk's rows of both grams are two products [n, Dk] x [Dk, end].
inline void KeyChunkDecays::decayed_grams(
    const float* q,
    const float* k,
    const float* k_transposed,
    float* k_gram,
    float* qk) {
  constexpr int C = kChunkSize;
  const int dk = dk_;
  q_rows_.resize(size_t(kSubChunkSize) * dk);
  k_rows_.resize(size_t(kSubChunkSize) * dk);
  columns_.resize(size_t(dk) * C);
  for (int first = 0; first < length_; first += kSubChunkSize) {
    const int n = std::min(kSubChunkSize, length_ - first);
    const int end = first + n;
    const float* sum_p = &log_sum_[size_t(first) * dk];
    for (int r = 0; r < n; ++r) {
      const int i = first + r;
      const float* sum_i = &log_sum_[size_t(i) * dk];
      const int* wipe_i = &last_wipe_[size_t(i) * dk];
      const float* q_i = q + size_t(i) * dk;
      const float* k_i = k + size_t(i) * dk;
      float* q_row = &q_rows_[size_t(r) * dk];
      float* k_row = &k_rows_[size_t(r) * dk];
#pragma omp simd
      for (int c = 0; c < dk; ++c) {
        const float decay = decay_exp(sum_i[c] - sum_p[c]);
        const float row_decay = wipe_i[c] > first ? 0.0f : decay;
        q_row[c] = row_decay * q_i[c];
        k_row[c] = row_decay * k_i[c];
      }
    }
    pair_channels_.clear();
    for (int c = 0; c < dk; ++c) {
      const float* sum_c = &log_sum_t_[size_t(c) * C];
      const float* k_c = k_transposed + size_t(c) * C;
      float* column = &columns_[size_t(c) * C];
      const float sum_first = sum_c[first];
      // A wipe in (j, first] for j < first; a wipe inside the sub-chunk.
      const int wipe_first = last_wipe_[size_t(first) * dk + c];
      const int wipe_end = last_wipe_[size_t(end - 1) * dk + c];
#pragma omp simd
      for (int j = 0; j < first; ++j) {
        const float decay = decay_exp(sum_first - sum_c[j]);
        column[j] = wipe_first > j ? 0.0f : decay * k_c[j];
      }
      float lowest = 0.0f, highest = 0.0f;
#pragma omp simd reduction(min : lowest) reduction(max : highest)
      for (int j = first; j < end; ++j) {
        lowest = std::min(lowest, sum_c[j] - sum_first);
        highest = std::max(highest, sum_c[j] - sum_first);
      }
      const bool product = wipe_end <= first && lowest >= -kProductLogLimit &&
          highest <= kProductLogLimit;
      if (!product) {
        pair_channels_.push_back(c);
        std::fill(column + first, column + end, 0.0f);
        continue;
      }
#pragma omp simd
      for (int j = first; j < end; ++j) {
        column[j] = decay_exp(sum_first - sum_c[j]) * k_c[j];
      }
    }
    for (int i = first; i < end; ++i) {
      std::fill(qk + i * C, qk + i * C + C, 0.0f);
      std::fill(k_gram + i * C, k_gram + i * C + C, 0.0f);
    }
    const float* columns = columns_.data();
    gemm(
        n,
        end,
        dk,
        1.0f,
        {q_rows_.data(), dk, 1},
        columns,
        C,
        qk + first * C,
        C);
    gemm(
        n,
        end,
        dk,
        1.0f,
        {k_rows_.data(), dk, 1},
        columns,
        C,
        k_gram + first * C,
        C);
    diagonal_pairs(q, k, first, n, pair_channels_, k_gram, qk);
    // Above the diagonal the product left what the grams do not hold, and
    // k_gram's diagonal is 0.
    for (int i = first; i < end; ++i) {
      std::fill(qk + i * C + i + 1, qk + i * C + C, 0.0f);
      std::fill(k_gram + i * C + i, k_gram + i * C + C, 0.0f);
    }
  }
}

inline void KeyChunkDecays::diagonal_pairs(
    const float* q,
    const float* k,
    int first,
    int n,
    const std::vector<int>& channels,
    float* k_gram,
    float* qk) const {
  constexpr int C = kChunkSize;
  if (channels.empty()) {
    return;
  }
  for (int i = first; i < first + n; ++i) {
    const float* q_i = q + size_t(i) * dk_;
    const float* k_i = k + size_t(i) * dk_;
    for (int j = first; j <= i; ++j) {
      const float* k_j = k + size_t(j) * dk_;
      float gram = 0.0f, query_gram = 0.0f;
      for (const int c : channels) {
        const float decayed_k = (*this)(i, j, c) * k_j[c];
        gram = multiply_add(k_i[c], decayed_k, gram);
        query_gram = multiply_add(q_i[c], decayed_k, query_gram);
      }
      k_gram[i * C + j] += gram;
      qk[i * C + j] += query_gram;
    }
  }
}

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
