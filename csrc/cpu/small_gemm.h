// Register-tiled products of the small matrices of the chunked form
// (64 x 128 by 128 x 128, 64 x 64 triangles): C += alpha * A B, or
// C = alpha * A B.
//
// A is read through two strides, so A^T costs nothing: (a_row, a_k) =
// (lda, 1) reads A, (1, lda) reads A^T. B and C are row-major. Each tile keeps
// a kTileRows x kTileCols block of C in registers (two vectors per row, 16
// accumulators with AVX-512, 12 with AVX2's 16 registers) and streams one row
// of B and one column of A per step; the compiler unrolls the fixed-size loops
// into vector FMAs. Tails fall back to narrower tiles, so any shape is handled
// without reading past the end.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/multiply_add.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

#if defined(__AVX512F__)
constexpr int kVectorFloats = 16;
constexpr int kTileRows = 8;
#else
constexpr int kVectorFloats = 8;
constexpr int kTileRows = 6;
#endif
constexpr int kTileCols = 2 * kVectorFloats;

// Triangular structure a product can skip: LowerA when A is zero above its
// diagonal (the inverse T, the decayed Q K^T), UpperA when A is zero below it
// (their transposes, read through A's strides in the backward), LowerC when
// only C's lower triangle is wanted (the grams); half of those products' work.
// LowerC computes whole vectors, so some entries just above the diagonal are
// written too: callers mask C's upper triangle themselves.
enum class Triangle { None, LowerA, UpperA, LowerC };

// Whether a product adds into C or overwrites it. Overwrite spares the caller
// zeroing C first (and the tile its reads of C): alpha * acc is what
// alpha * acc + 0 rounds to, but for the sign of a zero. LowerC leaves the
// entries above its vectors as they were, so its callers zero C and add.
enum class Output { Add, Overwrite };

struct MatrixA {
  const float* data;
  int64_t row_stride;  // between rows of A (the M index)
  int64_t k_stride;  // between columns of A (the K index)
};

template <int MR, int NR>
inline void gemm_tile(
    int k_size,
    float alpha,
    const float* a,
    int64_t a_row,
    int64_t a_k,
    const float* b,
    int64_t ldb,
    float* c,
    int64_t ldc,
    Output output) {
  float acc[MR][NR] = {};
  for (int k = 0; k < k_size; ++k) {
    const float* b_row = b + k * ldb;
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const float a_mk = a[m * a_row + k * a_k];
#pragma omp simd
      for (int n = 0; n < NR; ++n) {
        acc[m][n] = multiply_add(a_mk, b_row[n], acc[m][n]);
      }
    }
  }
  if (output == Output::Overwrite) {
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
#pragma omp simd
      for (int n = 0; n < NR; ++n) {
        c[m * ldc + n] = alpha * acc[m][n];
      }
    }
    return;
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma omp simd
    for (int n = 0; n < NR; ++n) {
      c[m * ldc + n] = multiply_add(alpha, acc[m][n], c[m * ldc + n]);
    }
  }
}

template <int MR>
inline void gemm_rows(
    int n_size,
    int k_size,
    float alpha,
    const float* a,
    int64_t a_row,
    int64_t a_k,
    const float* b,
    int64_t ldb,
    float* c,
    int64_t ldc,
    Output output) {
  int n = 0;
  for (; n + kTileCols <= n_size; n += kTileCols) {
    gemm_tile<MR, kTileCols>(
        k_size, alpha, a, a_row, a_k, b + n, ldb, c + n, ldc, output);
  }
  for (; n + kVectorFloats <= n_size; n += kVectorFloats) {
    gemm_tile<MR, kVectorFloats>(
        k_size, alpha, a, a_row, a_k, b + n, ldb, c + n, ldc, output);
  }
  for (; n < n_size; ++n) {
    gemm_tile<MR, 1>(
        k_size, alpha, a, a_row, a_k, b + n, ldb, c + n, ldc, output);
  }
}

// Rows [m, m + MR) of gemm's product below, skipping what `triangle` makes
// zero: the block reaches column / key index m + MR - 1 at most. LowerC rounds
// its columns up to whole vectors: a few more entries above the diagonal cost
// less than the narrow tail tiles they replace. UpperA: row m of A is zero
// before column m, so the sum starts there.
template <int MR>
inline void gemm_block(
    int m,
    int n_size,
    int k_size,
    float alpha,
    MatrixA a,
    const float* b,
    int64_t ldb,
    float* c,
    int64_t ldc,
    Triangle triangle,
    Output output) {
  const int block_end = m + MR;
  const int n_limit = triangle == Triangle::LowerC
      ? std::min(
            n_size,
            (block_end + kVectorFloats - 1) / kVectorFloats * kVectorFloats)
      : n_size;
  const int k_limit =
      triangle == Triangle::LowerA ? std::min(k_size, block_end) : k_size;
  const int k0 = triangle == Triangle::UpperA ? std::min(m, k_size) : 0;
  gemm_rows<MR>(
      n_limit,
      k_limit - k0,
      alpha,
      a.data + m * a.row_stride + k0 * a.k_stride,
      a.row_stride,
      a.k_stride,
      b + k0 * ldb,
      ldb,
      c + m * ldc,
      ldc,
      output);
}

// The `rows` (< kTileRows) rows left after gemm's whole tiles, from row m, as
// one tile of that many rows: row by row, a 1-row tile has two accumulators,
// too few to hide the latency of the multiply-adds that feed them (with AVX2,
// 64 rows are ten tiles of 6 and 4 rows, which took 30% of chunk_carry's
// product time one row at a time).
template <int MR>
inline void gemm_last_rows(
    int rows,
    int m,
    int n_size,
    int k_size,
    float alpha,
    MatrixA a,
    const float* b,
    int64_t ldb,
    float* c,
    int64_t ldc,
    Triangle triangle,
    Output output) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      gemm_block<MR>(
          m, n_size, k_size, alpha, a, b, ldb, c, ldc, triangle, output);
      return;
    }
    gemm_last_rows<MR - 1>(
        rows, m, n_size, k_size, alpha, a, b, ldb, c, ldc, triangle, output);
  }
}

// C[m_size, n_size] += alpha * A[m_size, k_size] B[k_size, n_size], or with
// Output::Overwrite C = alpha A B (not with Triangle::LowerC, see Output).
inline void gemm(
    int m_size,
    int n_size,
    int k_size,
    float alpha,
    MatrixA a,
    const float* b,
    int64_t ldb,
    float* c,
    int64_t ldc,
    Triangle triangle = Triangle::None,
    Output output = Output::Add) {
  int m = 0;
  for (; m + kTileRows <= m_size; m += kTileRows) {
    gemm_block<kTileRows>(
        m, n_size, k_size, alpha, a, b, ldb, c, ldc, triangle, output);
  }
  gemm_last_rows<kTileRows - 1>(
      m_size - m,
      m,
      n_size,
      k_size,
      alpha,
      a,
      b,
      ldb,
      c,
      ldc,
      triangle,
      output);
}

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
