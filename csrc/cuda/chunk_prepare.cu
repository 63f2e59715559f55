// chunk_prepare: the chunked form's per-chunk stages before the sequential
// pass (chunked_common.cuh), every chunk at once.
#include "cuda/chunked_common.cuh"

namespace mlx_gated_delta::cuda {

namespace {

// gate_cumsum: the in-chunk cumulative log decay over the finite gates and the
// last wipe (a decay that is exactly 0) at or before each token; decay(i, j)
// is 0 when a wipe lies in (j, i], decided by index (as the CPU's ChunkDecays).
struct ChunkGates {
  float* log_sum;  // [kChunk]
  int* last_wipe;  // [kChunk]

  __device__ float operator()(int i, int j) const {
    if (last_wipe[i] > j) {
      return 0.0f;
    }
    return expf(log_sum[i] - (j >= 0 ? log_sum[j] : 0.0f));
  }
};

// Whether value head h is the first of those that read its key head (the
// one that writes the key head's scratch).
__device__ bool first_of_key_head(const CoreArgs& a, int h) {
  return a.grouped ? h % (a.value_heads / a.key_heads) == 0 : h < a.key_heads;
}

// gate_cumsum into shared memory; beta and g are 0 for masked and padded
// tokens (no decay, no update).
__device__ void gate_cumsum(
    const CoreArgs& a,
    const ChunkPlace& place,
    float* gates,
    float* betas,
    ChunkGates decays) {
  const int i = threadIdx.x;
  if (i < kChunk) {
    const int64_t bt = int64_t(place.b) * a.tokens + place.t0 + i;
    const bool active = i < place.length && (a.mask == nullptr || a.mask[bt]);
    const int64_t gate = bt * a.value_heads + place.h;
    gates[i] = active ? a.g[gate] : 0.0f;
    betas[i] = active ? a.beta[gate] : 0.0f;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    int wipe_at = -1;
    for (int t = 0; t < kChunk; ++t) {
      const bool wipe = expf(gates[t]) == 0.0f;
      sum += wipe ? 0.0f : gates[t];
      wipe_at = wipe ? t : wipe_at;
      decays.log_sum[t] = sum;
      decays.last_wipe[t] = wipe_at;
    }
  }
  __syncthreads();
}

template <typename T>
__device__ __forceinline__ void chunk_prepare(
    const CoreArgs& a, const ChunkScratch& s) {
  extern __shared__ __align__(128) float shared[];
  const int dk = a.key_dim, dv = a.value_dim;
  const int kw = tile_padded(dk), vw = tile_padded(dv);
  const int kp = tile_stride(dk), vp = tile_stride(dv);
  const int lp = tile_stride(kChunk);
  // K, Q and V as they are in the inputs (ChunkRows::store), their qk_norm
  // scales apart: float16 and bfloat16 rows are exact tensor-core operands.
  constexpr bool kExact = kExactInTf32<T>;
  float* ks = shared;  // [kChunk][kp]
  // Q [kChunk][kp] for chunk_qk, then V [kChunk][vp] for recompute_w_u: one
  // buffer, so that two blocks fit in a multiprocessor's shared memory.
  float* qs = ks + kChunk * kp;
  float* vs = qs;
  // [kChunk][lp]: A, strictly lower, then recompute_w_u's T diag(coefficient)
  float* as = qs + kChunk * max(kp, vp);
  // [kChunk][lp]: T = (I + A)^-1, then recompute_w_u's T diag(beta)
  float* ts = as + kChunk * lp;
  // kkt_inverse's sums, one [kTile][tile_stride(kTile)] tile per block of a
  // distance from the diagonal.
  float* sums = ts + kChunk * lp;
  float* gates = sums + (kChunk / kTile - 1) * kTile * tile_stride(kTile);
  float* betas = gates + kChunk;
  float* log_sum = betas + kChunk;
  // beta_j decay(j, -1) / |k_j|: W's column scales of T
  float* coefficient = log_sum + kChunk;
  float* key_scales = coefficient + kChunk;  // 1 / |k_i| (qk_norm), else 1
  float* query_scales = key_scales + kChunk;  // likewise
  int* last_wipe = reinterpret_cast<int*>(query_scales + kChunk);
  const ChunkGates decays{log_sum, last_wipe};

  const ChunkPlace place = chunk_place(a, blockIdx.x);
  const int kh = key_head_of(a, place.h);
  const int64_t bt0 = int64_t(place.b) * a.tokens + place.t0;
  const T* q = static_cast<const T*>(a.q) + (bt0 * a.key_heads + kh) * dk;
  const T* k = static_cast<const T*>(a.k) + (bt0 * a.key_heads + kh) * dk;
  const T* v =
      static_cast<const T*>(a.v) + (bt0 * a.value_heads + place.h) * dv;
  const int64_t key_stride = int64_t(a.key_heads) * dk;
  // K's and Q's loads are in flight during gate_cumsum.
  ChunkRows keys, queries;
  keys.fetch(k, key_stride, dk, place.length);
  queries.fetch(q, key_stride, dk, place.length);
  gate_cumsum(a, place, gates, betas, decays);
  keys.store(dk, place.length, a.normalize_qk, key_scales, ks, kp);
  queries.store(dk, place.length, a.normalize_qk, query_scales, qs, kp);
  __syncthreads();
  // K's rows as they are, for chunk_carry: once per key head, by the block
  // of its first value head.
  if (first_of_key_head(a, place.h)) {
    const int chunks = (a.tokens + kChunk - 1) / kChunk;
    float* k_out = s.k +
        ((int64_t(place.b) * a.key_heads + kh) * chunks + place.chunk) *
            kChunk * kw;
    const int lane = threadIdx.x % kWarp;
    for (int i = threadIdx.x / kWarp; i < kChunk;
         i += kChunkedThreads / kWarp) {
      for (int c = 4 * lane; c < kw; c += 4 * kWarp) {
        *reinterpret_cast<float4*>(k_out + i * kw + c) =
            *reinterpret_cast<const float4*>(ks + i * kp + c);
      }
    }
  }

  // k_gram and chunk_qk, K K^T and Q K^T of the rows as they are (the scales
  // come with the decays): warp w the row tile w / 2 and the column tiles
  // 2 (w % 2) and 2 (w % 2) + 1; tiles above the diagonal are 0.
  // The products go to A's and T's buffers, which the next step rewrites.
  // V's loads are in flight meanwhile (V takes Q's buffer once Q is read).
  ChunkRows values;
  values.fetch(v, int64_t(a.value_heads) * dv, dv, place.length);
  const int warp = threadIdx.x / kWarp;
  {
    const int ti = warp / 2;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int tj = 2 * (warp % 2) + n;
      Product kk, qk;
      if (tj <= ti) {
        for (int c0 = 0; c0 < kw; c0 += 8) {
          const float* kj = ks + tj * kTile * kp + c0;
          kk.add<wmma::row_major, wmma::col_major, kExact, kExact>(
              ks + ti * kTile * kp + c0, kp, kj, kp);
          qk.add<wmma::row_major, wmma::col_major, kExact, kExact>(
              qs + ti * kTile * kp + c0, kp, kj, kp);
        }
      }
      const int tile = ti * kTile * lp + tj * kTile;
      wmma::store_matrix_sync(as + tile, kk.finish(), lp, wmma::mem_row_major);
      wmma::store_matrix_sync(ts + tile, qk.finish(), lp, wmma::mem_row_major);
    }
  }
  __syncthreads();
  // The decays and the qk_norm scales: kkt_inverse's A (strictly lower),
  // T's start (the identity) and the decayed Q K^T, each element read and
  // written by one thread.
  {
    float* qk_out = s.qk + place.index * kChunk * kChunk;
    for (int e = threadIdx.x; e < kChunk * kChunk; e += kChunkedThreads) {
      const int i = e / kChunk, j = e % kChunk;
      const float decay = j <= i ? decays(i, j) * key_scales[j] : 0.0f;
      qk_out[e] = decay * query_scales[i] * ts[i * lp + j];
      as[i * lp + j] = j < i
          ? betas[i] * decay * key_scales[i] * as[i * lp + j]
          : 0.0f;
      ts[i * lp + j] = i == j ? 1.0f : 0.0f;
    }
  }
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    coefficient[i] = betas[i] * decays(i, -1) * key_scales[i];
  }
  __syncthreads();
  // Q has been read: V takes its buffer, as it is (the barriers of
  // kkt_inverse order these writes before recompute_w_u reads them).
  values.store(dv, place.length, false, nullptr, vs, vp);

  // kkt_inverse: T = (I + A)^-1, I + A lower triangular in 16 x 16 blocks.
  // First each diagonal block, T_bb = (I + A_bb)^-1, by forward substitution
  // in warp b: once row m of the block is final, every later row i > m
  // subtracts A[i][m] T[m][j] (j <= m, where row m is not zero).
  if (warp < kChunk / kTile) {
    const int lane = threadIdx.x % kWarp;
    float* t_block = ts + warp * kTile * (lp + 1);
    const float* a_block = as + warp * kTile * (lp + 1);
    for (int m = 0; m < kTile - 1; ++m) {
      const int width = m + 1;
      for (int e = lane; e < (kTile - 1 - m) * width; e += kWarp) {
        const int i = m + 1 + e / width, j = e % width;
        t_block[i * lp + j] -= a_block[i * lp + m] * t_block[m * lp + j];
      }
      __syncwarp();
    }
  }
  __syncthreads();
  // Then the blocks below the diagonal, nearest first:
  // T_ij = -T_ii sum_{j <= k < i} A_ik T_kj, from blocks already final. Warp
  // t takes the t-th block of a distance, the sum in its own tile of `sums`.
  for (int distance = 1; distance < kChunk / kTile; ++distance) {
    const int i = distance + warp, j = warp;
    if (i < kChunk / kTile) {
      float* sum = sums + warp * kTile * tile_stride(kTile);
      Product inner;
      for (int k0 = j * kTile; k0 < i * kTile; k0 += 8) {
        inner.add<wmma::row_major, wmma::row_major>(
            as + i * kTile * lp + k0, lp, ts + k0 * lp + j * kTile, lp);
      }
      wmma::store_matrix_sync(
          sum, inner.finish(), tile_stride(kTile), wmma::mem_row_major);
      __syncwarp();
      Product outer;
      for (int k0 = 0; k0 < kTile; k0 += 8) {
        outer.add<wmma::row_major, wmma::row_major>(
            ts + i * kTile * (lp + 1) + k0, lp, sum + k0 * tile_stride(kTile),
            tile_stride(kTile));
      }
      Accumulator& t_ij = outer.finish();
#pragma unroll
      for (int e = 0; e < t_ij.num_elements; ++e) {
        t_ij.x[e] = -t_ij.x[e];
      }
      wmma::store_matrix_sync(
          ts + i * kTile * lp + j * kTile, t_ij, lp, wmma::mem_row_major);
    }
    __syncthreads();
  }

  // recompute_w_u: W = T diag(beta decay(i, -1) / |k_i|) K and
  // U = T diag(beta) V, the column scales on T (into A's buffer for W), so
  // that K and V stay as they are; the tiles of both straight to scratch
  // (rows of tile_padded width): warp w the column tiles w, w + 8, ... (W's
  // first, then U's), each for every row tile, the rows of K or V loaded
  // once for all of them. T is lower triangular, so row tile ti needs rows
  // j < 16 (ti + 1) of K, V: a warp's column tile is 20 steps whichever it
  // is.
  // The chunked backward keeps T (ChunkScratch::t); each element is read
  // here by the thread that rescales it below.
  for (int e = threadIdx.x; e < kChunk * kChunk; e += kChunkedThreads) {
    const int i = e / kChunk, j = e % kChunk;
    if (s.t != nullptr) {
      s.t[place.index * kChunk * kChunk + e] = ts[i * lp + j];
    }
    as[i * lp + j] = ts[i * lp + j] * coefficient[j];
    ts[i * lp + j] *= betas[j];
  }
  __syncthreads();
  {
    constexpr int kRowTiles = kChunk / kTile;
    const int w_tiles = kw / kTile;
    const int tiles = w_tiles + vw / kTile;
    for (int tile = warp; tile < tiles; tile += kChunkedThreads / kWarp) {
      const bool is_w = tile < w_tiles;
      const int column = (is_w ? tile : tile - w_tiles) * kTile;
      const float* operand = (is_w ? ks : vs) + column;
      const int stride = is_w ? kp : vp;
      const float* t_scaled = is_w ? as : ts;
      Product products[kRowTiles];
      for (int j0 = 0; j0 < kChunk; j0 += 8) {
        const Operand<OperandB<wmma::row_major>, kExact> rows(
            operand + j0 * stride, stride);
#pragma unroll
        for (int ti = 0; ti < kRowTiles; ++ti) {
          if (j0 < (ti + 1) * kTile) {
            const Operand<OperandA<wmma::row_major>, false> t(
                t_scaled + ti * kTile * lp + j0, lp);
            products[ti].add(t, rows);
          }
        }
      }
      const int width = is_w ? kw : vw;
      float* out = (is_w ? s.w : s.u) + place.index * kChunk * width + column;
#pragma unroll
      for (int ti = 0; ti < kRowTiles; ++ti) {
        wmma::store_matrix_sync(
            out + ti * kTile * width, products[ti].finish(), width,
            wmma::mem_row_major);
      }
    }
  }
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    float* out = s.decays + place.index * kDecayRows * kChunk;
    out[i] = decays(i, -1);
    out[kChunk + i] = i < place.length ? decays(place.length - 1, i) : 0.0f;
    out[2 * kChunk + i] = log_sum[i];
    out[3 * kChunk + i] = float(last_wipe[i]);
    out[4 * kChunk + i] = key_scales[i];
  }
}

}  // namespace

}  // namespace mlx_gated_delta::cuda

// The entry points the executor looks up by name: gd_chunk_prepare_<dtype>.
#define GD_CHUNK_PREPARE_ENTRY(type, suffix)             \
  extern "C" __global__ void __launch_bounds__(          \
      mlx_gated_delta::cuda::kChunkedThreads)            \
      gd_chunk_prepare_##suffix(                         \
          const mlx_gated_delta::cuda::CoreArgs a,       \
          const mlx_gated_delta::cuda::ChunkScratch s) { \
    mlx_gated_delta::cuda::chunk_prepare<type>(a, s);    \
  }
GD_CHUNK_PREPARE_ENTRY(float, f32)
GD_CHUNK_PREPARE_ENTRY(__half, f16)
GD_CHUNK_PREPARE_ENTRY(__nv_bfloat16, bf16)
