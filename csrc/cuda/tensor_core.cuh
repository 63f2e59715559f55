// Float32 matrix products on tensor cores for the chunked kernels: through the
// CUDA WMMA API (chunk_prepare.cu, chunk_output.cu), or PTX's mma.sync on
// operands in registers (mma_tf32 below: chunk_carry.cu).
//
// Tensor cores take float32 operands as TF32 (10 mantissa bits), which alone
// would break the core op's float32 contracts. Each operand is therefore split
// into its TF32 rounding and the TF32 rounding of the remainder, x = hi + lo,
// and a product is hi*hi + hi*lo + lo*hi (3xTF32): what it leaves out,
// lo*lo and the remainder's own rounding, is about 2^-22 of each term, near
// float32's 2^-24. Accumulation is float32.
//
// A WMMA tile here is the m16n16k8 TF32 shape: A [16 x 8], B [8 x 16], the
// accumulator [16 x 16]. The loads read float32 from memory with a row (or
// column) stride `ld` that is a multiple of 4 and a start that is 32-byte
// aligned (launch_shapes.h's tile_stride keeps both).
#pragma once

#include <mma.h>

#include <cstdint>

namespace mlx_gated_delta::cuda {

namespace wmma = nvcuda::wmma;

using Accumulator = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;
template <typename Layout>
using OperandA =
    wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, Layout>;
template <typename Layout>
using OperandB =
    wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, Layout>;

// hi holds float32 values; afterwards hi their TF32 rounding and lo the
// TF32 rounding of the rest. Element-wise, so the fragment's (unspecified)
// element order does not matter.
template <typename Fragment>
__device__ __forceinline__ void split_tf32(Fragment& hi, Fragment& lo) {
#pragma unroll
  for (int e = 0; e < hi.num_elements; ++e) {
    const float x = hi.x[e];
    const float rounded = wmma::__float_to_tf32(x);
    hi.x[e] = rounded;
    lo.x[e] = wmma::__float_to_tf32(x - rounded);
  }
}

// One operand of a product, loaded and split into hi and lo (lo unused, and
// not computed, where kExact: the values are exact in TF32, Product below).
template <typename Fragment, bool kExact>
struct Operand {
  Fragment hi, lo;

  __device__ __forceinline__ Operand(const float* values, unsigned ld) {
    wmma::load_matrix_sync(hi, values, ld);
    if constexpr (!kExact) {
      split_tf32(hi, lo);
    }
  }
};

// A 16 x 16 float32 product accumulated in 3xTF32 (add: += A B for A
// [16 x 8] at `a` and B [8 x 16] at `b`, in the layouts given, row_major or
// col_major). The hi*hi terms, and any starting value, go to `sum`; the
// hi*lo and lo*hi terms to `correction`, a second accumulator, so that only
// one of a step's three tensor-core products waits for the previous step's.
// finish() adds the two and returns the result.
//
// An operand whose values TF32 holds exactly (kExactA, kExactB) has no lo
// part, and its correction term is left out: float16 and bfloat16 values
// (11 and 8 significant bits; TF32 has 11, and float32's exponent range) as
// float32. With one exact operand a step is two products (2xTF32), with
// both one, whose every product is exact: only the float32 accumulation
// rounds, as in 3xTF32.
struct Product {
  Accumulator sum, correction;

  __device__ Product() {
    wmma::fill_fragment(sum, 0.0f);
    wmma::fill_fragment(correction, 0.0f);
  }

  template <
      typename LayoutA,
      typename LayoutB,
      bool kExactA = false,
      bool kExactB = false>
  __device__ __forceinline__ void add(
      const float* a, unsigned lda, const float* b, unsigned ldb) {
    Operand<OperandA<LayoutA>, kExactA> a_parts(a, lda);
    Operand<OperandB<LayoutB>, kExactB> b_parts(b, ldb);
    add(a_parts, b_parts);
  }

  // The same with operands already loaded (Operand), for an operand that
  // several products of a warp share.
  template <typename A, typename B, bool kExactA, bool kExactB>
  __device__ __forceinline__ void add(
      const Operand<A, kExactA>& a, const Operand<B, kExactB>& b) {
    if constexpr (!kExactA) {
      wmma::mma_sync(correction, a.lo, b.hi, correction);
    }
    if constexpr (!kExactB) {
      wmma::mma_sync(correction, a.hi, b.lo, correction);
    }
    wmma::mma_sync(sum, a.hi, b.hi, sum);
  }

  __device__ Accumulator& finish() {
#pragma unroll
    for (int e = 0; e < sum.num_elements; ++e) {
      sum.x[e] += correction.x[e];
    }
    return sum;
  }
};

// The same 3xTF32 split for a kernel that keeps its operands in registers
// and issues PTX's m16n8k8 products itself (mma_tf32, chunk_carry.cu): x's
// TF32 rounding and that of the rest, as the bit patterns mma.sync reads.
struct Tf32Parts {
  uint32_t hi, lo;
};
__device__ __forceinline__ Tf32Parts split_tf32(float x) {
  const float rounded = wmma::__float_to_tf32(x);
  return {
      __float_as_uint(rounded),
      __float_as_uint(wmma::__float_to_tf32(x - rounded))};
}

// d += a b on tensor cores, PTX's mma.sync m16n8k8 with TF32 operands and
// float32 accumulation, in its fragments: with g = lane / 4 and t = lane % 4,
// a holds A [16 x 8] at (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4), b
// holds B [8 x 8] at (t, g), (t + 4, g), and d holds D [16 x 8] at (g, 2t),
// (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
__device__ __forceinline__ void mma_tf32(
    float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace mlx_gated_delta::cuda
