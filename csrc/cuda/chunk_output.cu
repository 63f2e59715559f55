// chunk_output: the chunked form's output (chunked_common.cuh), every chunk
// at once.
#include "cuda/chunked_common.cuh"

namespace mlx_gated_delta::cuda {

namespace {

// chunk_output, every chunk at once, one block per (chunk, kOutputRows value
// columns, value head, batch row): y_i = scale (decay(i, -1) S q_i +
// sum_{j <= i} P_ij v'_j), 0 where masked, from the chunk's starting state S
// and v' that chunk_carry wrote. On tensor cores, (decay(i, -1) q_i) S^T and
// P V' in one accumulator per 16 x 16 output tile, warp w the tiles w, w + 8,
// ... (token tile t % 4, column tile t / 4).
template <typename T>
__device__ __forceinline__ void chunk_output(
    const CoreArgs& a, const ChunkScratch& s) {
  extern __shared__ __align__(128) float shared[];
  const int dk = a.key_dim, dv = a.value_dim;
  const int kw = tile_padded(dk), vw = tile_padded(dv);
  const int kp = tile_stride(dk), lp = tile_stride(kChunk);
  const int rp = tile_stride(kOutputRows);
  float* qs = shared;  // [kChunk][kp]: decay(i, -1) q_i
  float* ps = qs + kChunk * max(kp, rp);  // [kChunk][lp]: decayed Q K^T
  float* hs = ps + kChunk * lp;  // [kOutputRows][kp]: S's rows
  float* deltas = hs + kOutputRows * kp;  // [kChunk][rp]: v'
  // [kChunk][rp]: y before scale and mask, in Q's buffer once Q is read.
  float* ys = qs;

  const int tiles = (dv + kOutputRows - 1) / kOutputRows;
  const ChunkPlace place = chunk_place(a, blockIdx.x / tiles);
  const int row0 = (blockIdx.x % tiles) * kOutputRows;
  const int rows = min(kOutputRows, dv - row0);
  const int kh = key_head_of(a, place.h);
  const int64_t bt0 = int64_t(place.b) * a.tokens + place.t0;
  const T* q = static_cast<const T*>(a.q) + (bt0 * a.key_heads + kh) * dk;
  const float* from_start = s.decays + place.index * kDecayRows * kChunk;
  // The scratch is copied asynchronously while Q is loaded and normalised.
  copy_rows_async(
      s.qk + place.index * kChunk * kChunk, kChunk, kChunk, kChunk, ps, lp);
  copy_rows_async(
      s.h + place.index * dv * dk + int64_t(row0) * dk, dk, rows, dk, hs, kp);
  copy_rows_async(
      s.u + place.index * kChunk * vw + row0, vw, kChunk, rows, deltas, rp);
  __pipeline_commit();
  load_rows(
      q,
      int64_t(a.key_heads) * dk,
      dk,
      place.length,
      a.normalize_qk,
      from_start,
      qs,
      kp);
  // What the copies leave out is 0: S's rows past Dv (the last tile of a Dv
  // that is not a multiple of kOutputRows) and columns past Dk, and the
  // matching v' columns.
  {
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
    for (int r = warp; r < kOutputRows; r += kChunkedThreads / kWarp) {
      for (int c = lane; c < kw; c += kWarp) {
        if (r >= rows || c >= dk) {
          hs[r * kp + c] = 0.0f;
        }
      }
    }
    for (int i = warp; i < kChunk; i += kChunkedThreads / kWarp) {
      for (int r = lane; r < kOutputRows; r += kWarp) {
        if (r >= rows) {
          deltas[i * rp + r] = 0.0f;
        }
      }
    }
  }
  __pipeline_wait_prior(0);
  __syncthreads();

  constexpr int kTiles = kChunk / kTile * (kOutputRows / kTile);
  constexpr int kTilesPerWarp = kTiles * kWarp / kChunkedThreads;
  static_assert(kTilesPerWarp * kChunkedThreads == kTiles * kWarp, "whole tiles");
  Product products[kTilesPerWarp];
#pragma unroll
  for (int n = 0; n < kTilesPerWarp; ++n) {
    const int tile = threadIdx.x / kWarp + n * kChunkedThreads / kWarp;
    const int ti = tile % (kChunk / kTile), tr = tile / (kChunk / kTile);
    for (int c0 = 0; c0 < kw; c0 += 8) {
      products[n].add<wmma::row_major, wmma::col_major>(
          qs + ti * kTile * kp + c0, kp, hs + tr * kTile * kp + c0, kp);
    }
    // P is lower triangular: token tile ti needs v'_j for j < 16 (ti + 1).
    for (int j0 = 0; j0 < (ti + 1) * kTile; j0 += 8) {
      products[n].add<wmma::row_major, wmma::row_major>(
          ps + ti * kTile * lp + j0, lp, deltas + j0 * rp + tr * kTile, rp);
    }
  }
  __syncthreads();
#pragma unroll
  for (int n = 0; n < kTilesPerWarp; ++n) {
    const int tile = threadIdx.x / kWarp + n * kChunkedThreads / kWarp;
    const int ti = tile % (kChunk / kTile), tr = tile / (kChunk / kTile);
    wmma::store_matrix_sync(
        ys + ti * kTile * rp + tr * kTile, products[n].finish(), rp,
        wmma::mem_row_major);
  }
  __syncthreads();

  T* y_all = static_cast<T*>(a.y);
  for (int e = threadIdx.x; e < kChunk * kOutputRows; e += kChunkedThreads) {
    const int i = e / kOutputRows, r = e % kOutputRows;
    if (i < place.length && r < rows) {
      const int64_t bt = bt0 + i;
      const bool active = a.mask == nullptr || a.mask[bt];
      T* y_row = y_all + (bt * a.value_heads + place.h) * dv + row0;
      y_row[r] = from_float<T>(active ? a.scale * ys[i * rp + r] : 0.0f);
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
