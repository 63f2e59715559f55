// chunk_output: the chunked form's output (chunked_common.cuh), every chunk
// at once.
#include "cuda/chunked_common.cuh"

namespace mlx_gated_delta::cuda {

namespace {

// chunk_output, every chunk at once, one block per (chunk, kOutputRows value
// columns, value head, batch row): y_i = scale (decay(i, -1) S q_i +
// sum_{j <= i} P_ij v'_j), 0 where masked, from the chunk's starting state S
// and v' that chunk_carry wrote. On tensor cores, Q S^T of q as it is (an
// exact operand from float16 and bfloat16 inputs; its row scales
// decay(i, -1) / |q_i| come after) and P V', in two accumulators per 16 x 16
// output tile, warp w the tiles w and w + 8 (column tile t / 4; token tile
// t % 4 for the first, 3 - t % 4 for the second, so that each warp's P V'
// takes the same steps, P being lower triangular). With per-key gates Q
// comes decayed with its scale from chunk_prepare (ChunkScratch::q: float32,
// not exact) and decay(i, -1) is 1.
template <typename T>
__device__ __forceinline__ void chunk_output(
    const CoreArgs& a, const ChunkScratch& s) {
  extern __shared__ __align__(128) float shared[];
  const int dk = a.key_dim, dv = a.value_dim;
  const int kw = tile_padded(dk), vw = tile_padded(dv);
  const int kp = tile_stride(dk), lp = tile_stride(kChunk);
  const int rp = tile_stride(kOutputRows);
  static_assert(kOutputRows <= kChunk, "P V' fits in P's buffer");
  float* qs = shared;  // [kChunk][kp]: q_i as it is
  float* ps = qs + kChunk * max(kp, rp);  // [kChunk][lp]: decayed Q K^T
  float* hs = ps + kChunk * lp;  // [kOutputRows][kp]: S's rows
  float* deltas = hs + kOutputRows * kp;  // [kChunk][rp]: v'
  // q_i's row scales: 1 / |q_i| (qk_norm, else 1), then times decay(i, -1).
  float* query_scales = deltas + kChunk * rp;
  // Once Q and P are read: [kChunk][rp] Q S^T in Q's buffer, [kChunk][lp]
  // P V' in P's.
  float* inter = qs;
  float* intra = ps;

  const int tiles = (dv + kOutputRows - 1) / kOutputRows;
  const ChunkPlace place = chunk_place(a, blockIdx.x / tiles);
  const int row0 = (blockIdx.x % tiles) * kOutputRows;
  const int rows = min(kOutputRows, dv - row0);
  const int64_t bt0 = int64_t(place.b) * a.tokens + place.t0;
  // decay(i, -1), needed last: its load is in flight meanwhile.
  const float from_start = threadIdx.x < kChunk
      ? s.decays[place.index * kDecayRows * kChunk + threadIdx.x]
      : 0.0f;
  // The scratch is copied asynchronously while Q is loaded.
  copy_rows_async(
      s.qk + place.index * kChunk * kChunk, kChunk, kChunk, kChunk, ps, lp);
  copy_rows_async(
      s.h + place.index * dv * dk + int64_t(row0) * dk, dk, rows, dk, hs, kp);
  copy_rows_async(
      s.u + place.index * kChunk * vw + row0, vw, kChunk, rows, deltas, rp);
  __pipeline_commit();
  const bool per_key = a.per_key_gates != 0;
  load_chunk_queries<T>(a, s, place, query_scales, qs, kp);
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
  static_assert(kTilesPerWarp == 2, "two tiles a warp, token tiles paired");
  // Warp w's n-th tile: token tile and column tile.
  const auto tile_of = [](int n) {
    const int tile = threadIdx.x / kWarp + n * kChunkedThreads / kWarp;
    const int t = tile % (kChunk / kTile);
    return int2{n == 0 ? t : kChunk / kTile - 1 - t, tile / (kChunk / kTile)};
  };
  Product inter_products[kTilesPerWarp], intra_products[kTilesPerWarp];
#pragma unroll
  for (int n = 0; n < kTilesPerWarp; ++n) {
    const int2 at = tile_of(n);
    const int ti = at.x, tr = at.y;
    for (int c0 = 0; c0 < kw; c0 += 8) {
      const float* q_tile = qs + ti * kTile * kp + c0;
      const float* s_tile = hs + tr * kTile * kp + c0;
      if (per_key) {
        inter_products[n].add<wmma::row_major, wmma::col_major, false, false>(
            q_tile, kp, s_tile, kp);
      } else {
        inter_products[n]
            .add<wmma::row_major, wmma::col_major, kExactInTf32<T>, false>(
                q_tile, kp, s_tile, kp);
      }
    }
    inter_products[n].finish();
    // P is lower triangular: token tile ti needs v'_j for j < 16 (ti + 1).
    for (int j0 = 0; j0 < (ti + 1) * kTile; j0 += 8) {
      intra_products[n].add<wmma::row_major, wmma::row_major>(
          ps + ti * kTile * lp + j0, lp, deltas + j0 * rp + tr * kTile, rp);
    }
  }
  __syncthreads();
  if (threadIdx.x < kChunk) {
    query_scales[threadIdx.x] *= from_start;
  }
#pragma unroll
  for (int n = 0; n < kTilesPerWarp; ++n) {
    const int2 at = tile_of(n);
    const int ti = at.x, tr = at.y;
    wmma::store_matrix_sync(
        inter + ti * kTile * rp + tr * kTile, inter_products[n].sum, rp,
        wmma::mem_row_major);
    wmma::store_matrix_sync(
        intra + ti * kTile * lp + tr * kTile, intra_products[n].finish(), lp,
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
      const float y =
          query_scales[i] * inter[i * rp + r] + intra[i * lp + r];
      y_row[r] = from_float<T>(active ? a.scale * y : 0.0f);
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
