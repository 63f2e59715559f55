// chunk_output: the chunked form's output (chunked_common.cuh), every chunk
// at once.
#include "cuda/chunked_common.cuh"

namespace mlx_gated_delta::cuda {

namespace {

// A block per (chunk, value head, batch row), warp w the tokens
// 32 (w / 4) to 32 (w / 4) + 31 of the chunk and the value columns
// 32 (w % 4) to 32 (w % 4) + 31: two token tiles of 16 by four column
// tiles of 8, the accumulators of PTX's m16n8k8 products (tensor_core.cuh's
// mma_tf32). The operands come straight from global memory into the
// fragments' registers (each a lane's two adjacent values of a row): no
// shared memory, no barrier.
constexpr int kWarpTokens = 32;
constexpr int kWarpColumns = 32;
constexpr int kOutputColumnGroups = kChunkedMaxDim / kWarpColumns;
constexpr int kTokenTiles = kWarpTokens / kTile;
constexpr int kColumnTiles = kWarpColumns / 8;
static_assert(
    kChunk / kWarpTokens * kOutputColumnGroups * kWarp == kChunkedThreads,
    "a warp for each (token group, column group)");

// Columns c and c + 1 of a row of `width` values as float32, 0 past width:
// one load where the pair is aligned.
template <typename T>
__device__ __forceinline__ float2 load_pair(const T* row, int c, int width) {
  if (c + 1 < width &&
      reinterpret_cast<uintptr_t>(row + c) % (2 * sizeof(T)) == 0) {
    if constexpr (std::is_same_v<T, float>) {
      return *reinterpret_cast<const float2*>(row + c);
    } else if constexpr (std::is_same_v<T, __half>) {
      return __half22float2(*reinterpret_cast<const __half2*>(row + c));
    } else {
      return __bfloat1622float2(
          *reinterpret_cast<const __nv_bfloat162*>(row + c));
    }
  }
  return make_float2(
      c < width ? to_float(row[c]) : 0.0f,
      c + 1 < width ? to_float(row[c + 1]) : 0.0f);
}

// Columns c and c + 1 of a row of `width` values, those within width.
template <typename T>
__device__ __forceinline__ void store_pair(
    T* row, int c, int width, float x, float y) {
  if (c + 1 < width &&
      reinterpret_cast<uintptr_t>(row + c) % (2 * sizeof(T)) == 0) {
    if constexpr (std::is_same_v<T, float>) {
      *reinterpret_cast<float2*>(row + c) = make_float2(x, y);
    } else if constexpr (std::is_same_v<T, __half>) {
      *reinterpret_cast<__half2*>(row + c) = __floats2half2_rn(x, y);
    } else {
      *reinterpret_cast<__nv_bfloat162*>(row + c) = __floats2bfloat162_rn(x, y);
    }
    return;
  }
  if (c < width) {
    row[c] = from_float<T>(x);
  }
  if (c + 1 < width) {
    row[c + 1] = from_float<T>(y);
  }
}

// The TF32 parts of an operand pair: hi and lo where the values need them,
// hi alone (lo 0, its products skipped) where they are exact (kExact).
template <bool kExact>
__device__ __forceinline__ void operand_parts(
    float x, uint32_t& hi, uint32_t& lo) {
  if constexpr (kExact) {
    hi = __float_as_uint(x);
    lo = 0;
  } else {
    const Tf32Parts parts = split_tf32(x);
    hi = parts.hi;
    lo = parts.lo;
  }
}

// chunk_output, every chunk at once: y_i = scale (decay(i, -1) S q_i /
// |q_i| + sum_{j <= i} P_ij v'_j), 0 where masked, from the chunk's starting
// state S and v' that chunk_carry wrote and the decayed Q K^T P of
// chunk_prepare. Q S^T first, of q as it is (an exact operand from float16
// and bfloat16 inputs, S in 3xTF32's two parts), each lane adding up the
// squares of the q values it loads for qk_norm; then the rows' scales
// decay(i, -1) / |q_i| on the accumulators, and P V' (3xTF32) added into
// them. A k index t of a product and t + 4 are the columns 2t and 2t + 1
// of its 8 (tokens, for P V'), so that a lane's operands are adjacent.
template <typename T>
__device__ __forceinline__ void chunk_output(
    const CoreArgs& a, const ChunkScratch& s) {
  constexpr bool kExactQueries = kExactInTf32<T>;
  const int dk = a.key_dim, dv = a.value_dim;
  const int vw = tile_padded(dv);
  const ChunkPlace place = chunk_place(a, blockIdx.x);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int g = lane / 4, t = lane % 4;
  const int token0 = warp / kOutputColumnGroups * kWarpTokens;
  const int column0 = warp % kOutputColumnGroups * kWarpColumns;
  if (column0 >= dv || token0 >= place.length) {
    return;
  }
  const int kh = key_head_of(a, place.h);
  const int64_t bt0 = int64_t(place.b) * a.tokens + place.t0;
  const int64_t query_stride = int64_t(a.key_heads) * dk;
  const T* q = static_cast<const T*>(a.q) + (bt0 * a.key_heads + kh) * dk;
  const float* state = s.h + place.index * dv * dk;

  float y[kTokenTiles][kColumnTiles][4] = {};
  float squares[kTokenTiles][2] = {};
#pragma unroll
  for (int c0 = 0; c0 < kChunkedMaxDim; c0 += 8) {
    if (c0 < dk) {
      const int c = c0 + 2 * t;
      uint32_t q_hi[kTokenTiles][4], q_lo[kTokenTiles][4];
#pragma unroll
      for (int m = 0; m < kTokenTiles; ++m) {
        const int i = token0 + kTile * m + g;
        const float2 top = i < place.length
            ? load_pair(q + i * query_stride, c, dk)
            : make_float2(0.0f, 0.0f);
        const float2 bottom = i + 8 < place.length
            ? load_pair(q + (i + 8) * query_stride, c, dk)
            : make_float2(0.0f, 0.0f);
        squares[m][0] += top.x * top.x + top.y * top.y;
        squares[m][1] += bottom.x * bottom.x + bottom.y * bottom.y;
        operand_parts<kExactQueries>(top.x, q_hi[m][0], q_lo[m][0]);
        operand_parts<kExactQueries>(bottom.x, q_hi[m][1], q_lo[m][1]);
        operand_parts<kExactQueries>(top.y, q_hi[m][2], q_lo[m][2]);
        operand_parts<kExactQueries>(bottom.y, q_hi[m][3], q_lo[m][3]);
      }
#pragma unroll
      for (int n = 0; n < kColumnTiles; ++n) {
        const int r = column0 + 8 * n + g;
        const float2 pair = r < dv ? load_pair(state + int64_t(r) * dk, c, dk)
                                   : make_float2(0.0f, 0.0f);
        const Tf32Parts s0 = split_tf32(pair.x), s1 = split_tf32(pair.y);
        const uint32_t s_hi[2] = {s0.hi, s1.hi}, s_lo[2] = {s0.lo, s1.lo};
#pragma unroll
        for (int m = 0; m < kTokenTiles; ++m) {
          mma_tf32(y[m][n], q_hi[m], s_hi);
          mma_tf32(y[m][n], q_hi[m], s_lo);
          if constexpr (!kExactQueries) {
            mma_tf32(y[m][n], q_lo[m], s_hi);
          }
        }
      }
    }
  }
  // decay(i, -1) / |q_i| (qk_norm, else decay(i, -1)) on the rows g and
  // g + 8 of each token tile, the squares summed over the row's four lanes.
  const float* from_start = s.decays + place.index * kDecayRows * kChunk;
#pragma unroll
  for (int m = 0; m < kTokenTiles; ++m) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = squares[m][half];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float row_scale = (a.normalize_qk ? inverse_norm(sum) : 1.0f) *
          from_start[token0 + kTile * m + g + 8 * half];
#pragma unroll
      for (int n = 0; n < kColumnTiles; ++n) {
        y[m][n][2 * half] *= row_scale;
        y[m][n][2 * half + 1] *= row_scale;
      }
    }
  }

  // P V': P is lower triangular, so token tile m needs v'_j for j below its
  // last token.
  const float* p = s.qk + place.index * kChunk * kChunk;
  const float* deltas = s.u + place.index * kChunk * vw;
#pragma unroll
  for (int j0 = 0; j0 < kChunk; j0 += 8) {
    if (j0 < token0 + kWarpTokens) {
      uint32_t v_hi[kColumnTiles][2], v_lo[kColumnTiles][2];
#pragma unroll
      for (int n = 0; n < kColumnTiles; ++n) {
        const int r = column0 + 8 * n + g;
        const float* column = deltas + (j0 + 2 * t) * vw + r;
        const float v0 = r < vw ? column[0] : 0.0f;
        const float v1 = r < vw ? column[vw] : 0.0f;
        operand_parts<false>(v0, v_hi[n][0], v_lo[n][0]);
        operand_parts<false>(v1, v_hi[n][1], v_lo[n][1]);
      }
#pragma unroll
      for (int m = 0; m < kTokenTiles; ++m) {
        if (j0 < token0 + kTile * (m + 1)) {
          const int i = token0 + kTile * m + g;
          const float2 top =
              *reinterpret_cast<const float2*>(p + i * kChunk + j0 + 2 * t);
          const float2 bottom = *reinterpret_cast<const float2*>(
              p + (i + 8) * kChunk + j0 + 2 * t);
          uint32_t hi[4], lo[4];
          operand_parts<false>(top.x, hi[0], lo[0]);
          operand_parts<false>(bottom.x, hi[1], lo[1]);
          operand_parts<false>(top.y, hi[2], lo[2]);
          operand_parts<false>(bottom.y, hi[3], lo[3]);
#pragma unroll
          for (int n = 0; n < kColumnTiles; ++n) {
            mma_tf32(y[m][n], hi, v_hi[n]);
            mma_tf32(y[m][n], lo, v_hi[n]);
            mma_tf32(y[m][n], hi, v_lo[n]);
          }
        }
      }
    }
  }

  T* y_all = static_cast<T*>(a.y);
#pragma unroll
  for (int m = 0; m < kTokenTiles; ++m) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = token0 + kTile * m + g + 8 * half;
      if (i < place.length) {
        const int64_t bt = bt0 + i;
        const bool active = a.mask == nullptr || a.mask[bt];
        T* y_row = y_all + (bt * a.value_heads + place.h) * dv;
#pragma unroll
        for (int n = 0; n < kColumnTiles; ++n) {
          const float* x = y[m][n] + 2 * half;
          store_pair(
              y_row,
              column0 + 8 * n + 2 * t,
              dv,
              active ? a.scale * x[0] : 0.0f,
              active ? a.scale * x[1] : 0.0f);
        }
      }
    }
  }
}

}  // namespace

}  // namespace mlx_gated_delta::cuda

// The entry points the executor looks up by name: gd_chunk_output_<dtype>.
#define GD_CHUNK_OUTPUT_ENTRY(type, suffix)              \
  extern "C" __global__ void __launch_bounds__(          \
      mlx_gated_delta::cuda::kChunkedThreads)            \
      gd_chunk_output_##suffix(                          \
          const mlx_gated_delta::cuda::CoreArgs a,       \
          const mlx_gated_delta::cuda::ChunkScratch s) { \
    mlx_gated_delta::cuda::chunk_output<type>(a, s);     \
  }
GD_CHUNK_OUTPUT_ENTRY(float, f32)
GD_CHUNK_OUTPUT_ENTRY(__half, f16)
GD_CHUNK_OUTPUT_ENTRY(__nv_bfloat16, bf16)
