// The chunked WY form on CUDA (docs/stages.md), scalar gates, in three
// kernels:
//
//   chunk_prepare  one block per (chunk, value head, batch row), all chunks at
//                  once: qk_norm, gate_cumsum, k_gram, chunk_qk, kkt_inverse
//                  and recompute_w_u of one chunk, writing W, U, the decayed
//                  Q K^T, the chunk's decays and its normalised K to scratch
//                  (ChunkScratch).
//   chunk_carry    one block per (kCarryRows state rows, value head, batch
//                  row), the chunks in order: v' = U - W S^T, the checkpoints
//                  and the next state (chunk_carry_state); it writes v' and
//                  each chunk's starting state to scratch.
//   chunk_output   one block per (chunk, kOutputRows value columns, value
//                  head, batch row), all chunks at once: the inter-chunk
//                  readout S q_i plus the decayed Q K^T times v'.
//
// The sequential pass does only what the next chunk depends on; the output,
// which nothing later reads, leaves the chain.
//
// Everything is float32 in shared memory, in rows of tile_stride floats
// (launch_shapes.h). The matrix products run on tensor cores in 3xTF32
// (tensor_core.cuh), one 16 x 16 output tile per warp at a time; gates,
// decays and kkt_inverse's diagonal blocks are float32 FMA.
#include <cuda_pipeline.h>

#include "cuda/device_common.cuh"
#include "cuda/launch_shapes.h"
#include "cuda/tensor_core.cuh"

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

// One chunk's rows [0, kChunk) of a [T, heads, dim] activation (token t's
// row at source + t * token_stride), in registers: warp w holds rows
// [kRowsPerWarp w, kRowsPerWarp (w + 1)), lane the columns lane + 32 j
// (dim <= kChunkedMaxDim), 0 past the chunk's `length` tokens. fetch issues
// every load before any is used (their latency, not their bytes, bounds this
// step), so a kernel can fetch early and store once the shared rows are free.
constexpr int kColumnsPerLane = kChunkedMaxDim / kWarp;

struct ChunkRows {
  static constexpr int kRowsPerWarp = kChunk * kWarp / kChunkedThreads;
  float x[kRowsPerWarp][kColumnsPerLane];

  template <typename T>
  __device__ void fetch(
      const T* source, int64_t token_stride, int dim, int length) {
    const int lane = threadIdx.x % kWarp;
    const int i0 = threadIdx.x / kWarp * kRowsPerWarp;
#pragma unroll
    for (int n = 0; n < kRowsPerWarp; ++n) {
#pragma unroll
      for (int j = 0; j < kColumnsPerLane; ++j) {
        const int c = lane + kWarp * j;
        x[n][j] = (i0 + n < length && c < dim)
            ? to_float(source[(i0 + n) * token_stride + c])
            : 0.0f;
      }
    }
  }

  // Into shared rows of stride `stride`, columns [0, tile_padded(dim)),
  // L2-normalised with `normalize`, row i times row_scales[i] unless
  // row_scales is null.
  __device__ void store(
      int dim, int length, bool normalize, const float* row_scales,
      float* rows, int stride) const {
    const int lane = threadIdx.x % kWarp;
    const int i0 = threadIdx.x / kWarp * kRowsPerWarp;
    const int width = tile_padded(dim);
#pragma unroll
    for (int n = 0; n < kRowsPerWarp; ++n) {
      float scale = row_scales != nullptr ? row_scales[i0 + n] : 1.0f;
      if (normalize) {
        float squares = 0.0f;
#pragma unroll
        for (int j = 0; j < kColumnsPerLane; ++j) {
          squares += x[n][j] * x[n][j];
        }
        scale = i0 + n < length ? scale * inverse_norm(warp_sum(squares)) : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kColumnsPerLane; ++j) {
        const int c = lane + kWarp * j;
        if (c < width) {
          rows[(i0 + n) * stride + c] = x[n][j] * scale;
        }
      }
    }
  }
};

template <typename T>
__device__ void load_rows(
    const T* source,
    int64_t token_stride,
    int dim,
    int length,
    bool normalize,
    const float* row_scales,
    float* rows,
    int stride) {
  ChunkRows chunk_rows;
  chunk_rows.fetch(source, token_stride, dim, length);
  chunk_rows.store(dim, length, normalize, row_scales, rows, stride);
}

// Asynchronous copies of float32 scratch into shared memory (cp.async
// through CUDA's pipeline primitives): rows [0, rows) of `width` columns of a
// row-major block (row stride `source_stride`) into shared rows of stride
// `stride` (a multiple of 4, 16-byte aligned); warp w the rows w, w + 8, ...,
// each lane 4 floats at a time where the rows allow 16-byte copies, else
// single floats. The copies land once the thread has waited for them
// (__pipeline_wait_prior) and the block has passed a barrier.
__device__ void copy_rows_async(
    const float* source,
    int64_t source_stride,
    int rows,
    int width,
    float* shared_rows,
    int stride) {
  const int lane = threadIdx.x % kWarp;
  const bool vectors = width % 4 == 0 && source_stride % 4 == 0 &&
      reinterpret_cast<uintptr_t>(source) % 16 == 0;
  const int step = vectors ? 4 : 1;
  for (int r = threadIdx.x / kWarp; r < rows; r += kChunkedThreads / kWarp) {
    for (int c = step * lane; c < width; c += step * kWarp) {
      __pipeline_memcpy_async(
          shared_rows + r * stride + c,
          source + r * source_stride + c,
          sizeof(float) * step);
    }
  }
}

// Whether value head h is the first of those that read its key head (the
// one that writes the key head's scratch).
__device__ bool first_of_key_head(const CoreArgs& a, int h) {
  return a.grouped ? h % (a.value_heads / a.key_heads) == 0 : h < a.key_heads;
}

struct ChunkPlace {
  int b, h, chunk, t0, length;
  int64_t index;  // (b * Hv + h) * chunks + chunk
};

__device__ ChunkPlace chunk_place(const CoreArgs& a, int chunk) {
  ChunkPlace place;
  place.b = blockIdx.z;
  place.h = blockIdx.y;
  place.chunk = chunk;
  place.t0 = chunk * kChunk;
  place.length = min(kChunk, a.tokens - place.t0);
  const int chunks = (a.tokens + kChunk - 1) / kChunk;
  place.index = (int64_t(place.b) * a.value_heads + place.h) * chunks + chunk;
  return place;
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
  float* ks = shared;  // [kChunk][kp]
  // Q [kChunk][kp] for chunk_qk, then V [kChunk][vp] for recompute_w_u: one
  // buffer, so that two blocks fit in a multiprocessor's shared memory.
  float* qs = ks + kChunk * kp;
  float* vs = qs;
  float* as = qs + kChunk * max(kp, vp);  // [kChunk][lp]: A, strictly lower
  float* ts = as + kChunk * lp;  // [kChunk][lp]: T = (I + A)^-1
  // kkt_inverse's sums, one [kTile][tile_stride(kTile)] tile per block of a
  // distance from the diagonal.
  float* sums = ts + kChunk * lp;
  float* gates = sums + (kChunk / kTile - 1) * kTile * tile_stride(kTile);
  float* betas = gates + kChunk;
  float* log_sum = betas + kChunk;
  float* coefficient = log_sum + kChunk;  // beta_j decay(j, -1)
  int* last_wipe = reinterpret_cast<int*>(coefficient + kChunk);
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
  keys.store(dk, place.length, a.normalize_qk, nullptr, ks, kp);
  queries.store(dk, place.length, a.normalize_qk, nullptr, qs, kp);
  __syncthreads();
  // K's rows as they are now, for chunk_carry: once per key head, by the
  // block of its first value head.
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

  // k_gram and chunk_qk, K K^T and Q K^T: warp w the row tile w / 2 and the
  // column tiles 2 (w % 2) and 2 (w % 2) + 1; tiles above the diagonal are 0.
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
          kk.add<wmma::row_major, wmma::col_major>(
              ks + ti * kTile * kp + c0, kp, kj, kp);
          qk.add<wmma::row_major, wmma::col_major>(
              qs + ti * kTile * kp + c0, kp, kj, kp);
        }
      }
      const int tile = ti * kTile * lp + tj * kTile;
      wmma::store_matrix_sync(as + tile, kk.finish(), lp, wmma::mem_row_major);
      wmma::store_matrix_sync(ts + tile, qk.finish(), lp, wmma::mem_row_major);
    }
  }
  __syncthreads();
  // The decays: kkt_inverse's A (strictly lower), T's start (the identity)
  // and the decayed Q K^T, each element read and written by one thread.
  {
    float* qk_out = s.qk + place.index * kChunk * kChunk;
    for (int e = threadIdx.x; e < kChunk * kChunk; e += kChunkedThreads) {
      const int i = e / kChunk, j = e % kChunk;
      const float decay = j <= i ? decays(i, j) : 0.0f;
      qk_out[e] = decay * ts[i * lp + j];
      as[i * lp + j] = j < i ? betas[i] * decay * as[i * lp + j] : 0.0f;
      ts[i * lp + j] = i == j ? 1.0f : 0.0f;
    }
  }
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    coefficient[i] = betas[i] * decays(i, -1);
  }
  __syncthreads();
  // Q has been read: V takes its buffer, its rows times beta; K's rows take
  // their coefficient (the barriers of kkt_inverse order these writes before
  // recompute_w_u reads them).
  values.store(dv, place.length, false, betas, vs, vp);
  for (int j = warp; j < kChunk; j += kChunkedThreads / kWarp) {
    for (int c = threadIdx.x % kWarp; c < kw; c += kWarp) {
      ks[j * kp + c] *= coefficient[j];
    }
  }

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

  // recompute_w_u: W = T diag(beta decay(i, -1)) K, U = T diag(beta) V, the
  // tiles of both straight to scratch (rows of tile_padded width): warp w
  // the row tile w % 4 and every other column tile from w / 4, W's first.
  // T is lower triangular, so row tile ti needs rows j < 16 (ti + 1) of K, V.
  {
    const int ti = warp % 4;
    const int w_tiles = kw / kTile;
    const int tiles = w_tiles + vw / kTile;
    for (int tile = warp / 4; tile < tiles; tile += 2) {
      const bool is_w = tile < w_tiles;
      const int column = (is_w ? tile : tile - w_tiles) * kTile;
      const float* operand = (is_w ? ks : vs) + column;
      const int stride = is_w ? kp : vp;
      Product product;
      for (int j0 = 0; j0 < (ti + 1) * kTile; j0 += 8) {
        product.add<wmma::row_major, wmma::row_major>(
            ts + ti * kTile * lp + j0, lp, operand + j0 * stride, stride);
      }
      const int width = is_w ? kw : vw;
      float* out = (is_w ? s.w : s.u) + place.index * kChunk * width +
          ti * kTile * width + column;
      wmma::store_matrix_sync(out, product.finish(), width, wmma::mem_row_major);
    }
  }
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    float* out = s.decays + place.index * kDecayRows * kChunk;
    out[i] = decays(i, -1);
    out[kChunk + i] = i < place.length ? decays(place.length - 1, i) : 0.0f;
    out[2 * kChunk + i] = log_sum[i];
    out[3 * kChunk + i] = float(last_wipe[i]);
  }
}

// One chunk's W, U tile (kCarryRows columns of U from row0; U's rows are
// tile_padded(Dv) wide and 0 past Dv, so the tile is whole) and decays.
__device__ void copy_chunk_async(
    const ChunkScratch& s,
    int64_t index,
    int kw,
    int vw,
    int row0,
    float* ws,
    int kp,
    float* us,
    int rp,
    float* decays) {
  copy_rows_async(s.w + index * kChunk * kw, kw, kChunk, kw, ws, kp);
  static_assert(
      kChunk * kCarryRows / 4 == kChunkedThreads, "one U vector a thread");
  {
    const int i = threadIdx.x / (kCarryRows / 4);
    const int c = 4 * (threadIdx.x % (kCarryRows / 4));
    __pipeline_memcpy_async(
        us + i * rp + c, s.u + (index * kChunk + i) * vw + row0 + c, 16);
  }
  static_assert(
      kDecayRows * kChunk <= 4 * kChunkedThreads, "one decay vector a thread");
  if (4 * threadIdx.x < kDecayRows * kChunk) {
    __pipeline_memcpy_async(
        decays + 4 * threadIdx.x,
        s.decays + index * kDecayRows * kChunk + 4 * threadIdx.x,
        16);
  }
}

// chunk_carry: the only sequential pass. Per chunk it reads W, U, K and the
// decays and does no more than the chain needs: v' = U - W S^T (written over
// U), the state at the chunk's start (ChunkScratch::h) for chunk_output, the
// checkpoints and the next state. The products on tensor cores: v' with warp
// w the token tile w % 4 and half w / 4 of Dk (the halves added after), the
// state update with warp w the state columns 16 w to 16 w + 15;
// chunk_checkpoint (FMA) state rows r = warp + 8 y and columns
// c = lane + 32 z.
//
// Nothing of the chain waits for global memory: the inputs are copied into
// shared memory asynchronously, each as soon as its buffer is free. The next
// chunk's W, U tile and decays (U and the decays double-buffered) from the
// end of W S^T, in flight during v' and the update; the next chunk's K (from
// chunk_prepare's scratch, normalised there once per key head) from the end
// of the update, in flight during the next W S^T and v'.
__device__ __forceinline__ void chunk_carry(
    const CoreArgs& a, const ChunkScratch& s) {
  constexpr int kRowTiles = kCarryRows / 8;
  extern __shared__ __align__(128) float shared[];
  const int dk = a.key_dim, dv = a.value_dim;
  const int kw = tile_padded(dk), vw = tile_padded(dv);
  const int kp = tile_stride(dk), rp = tile_stride(kCarryRows);
  float* state = shared;  // [kCarryRows][kp]
  float* ws = state + kCarryRows * kp;  // [kChunk][kp]: W
  float* ks = ws + kChunk * kp;  // [kChunk][kp]: K
  // [2][kChunk][rp]: U, then v', of even and odd chunks.
  float* u_buffers = ks + kChunk * kp;
  // [kChunk][rp]: W S^T over the first half of Dk, then decay(L-1, j) v'_j,
  // chunk_carry_state's left operand.
  float* carried = u_buffers + 2 * kChunk * rp;
  float* second_half = carried + kChunk * rp;  // [kChunk][rp]: the other half
  // [2][kDecayRows][kChunk]: the decays (ChunkScratch) of even and odd
  // chunks: from_start, to_end, then the cumulative logs and last wipes of
  // chunk_checkpoint's decay(i - 1, j).
  float* decay_buffers = second_half + kChunk * rp;

  const int b = blockIdx.z, h = blockIdx.y;
  const int row0 = blockIdx.x * kCarryRows;
  const int rows = min(kCarryRows, dv - row0);
  const int kh = key_head_of(a, h);
  const int64_t head_state = (int64_t(b) * a.value_heads + h) * dv * dk;
  const int chunks = (a.tokens + kChunk - 1) / kChunk;
  const int64_t key_chunks = (int64_t(b) * a.key_heads + kh) * chunks;
  copy_chunk_async(
      s,
      chunk_place(a, 0).index,
      kw,
      vw,
      row0,
      ws,
      kp,
      u_buffers,
      rp,
      decay_buffers);
  __pipeline_commit();
  copy_rows_async(s.k + key_chunks * kChunk * kw, kw, kChunk, kw, ks, kp);
  __pipeline_commit();
  // Rows past Dv and columns past Dk are 0 (tile padding).
  for (int e = threadIdx.x; e < kCarryRows * kw; e += kChunkedThreads) {
    const int r = e / kw, c = e % kw;
    state[r * kp + c] = r < rows && c < dk
        ? a.state_in[head_state + int64_t(row0 + r) * dk + c]
        : 0.0f;
  }

  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  int next_checkpoint = 0;
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const ChunkPlace place = chunk_place(a, chunk);
    float* u = s.u + place.index * kChunk * vw + row0;
    float* deltas = u_buffers + (chunk % 2) * kChunk * rp;  // U, then v'
    const float* decays = decay_buffers + (chunk % 2) * kDecayRows * kChunk;
    const float* from_start = decays;
    const float* to_end = decays + kChunk;
    const float* log_sum = decays + 2 * kChunk;
    const float* last_wipe = decays + 3 * kChunk;
    // This chunk's W, U and decays have landed (its K may not have).
    __pipeline_wait_prior(1);
    __syncthreads();
    // The state at the chunk's start, for chunk_output.
    float* h_out = s.h + place.index * dv * dk + int64_t(row0) * dk;
    for (int r = warp; r < rows; r += kChunkedThreads / kWarp) {
      for (int c = lane; c < dk; c += kWarp) {
        h_out[r * dk + c] = state[r * kp + c];
      }
    }

    // chunk_carry: W S^T, in two halves of Dk.
    {
      const int ti = warp % 4, half = warp / 4;
      Product product;
      for (int c0 = half * kw / 2; c0 < (half + 1) * kw / 2; c0 += 8) {
        product.add<wmma::row_major, wmma::col_major>(
            ws + ti * kTile * kp + c0, kp, state + c0, kp);
      }
      wmma::store_matrix_sync(
          (half == 0 ? carried : second_half) + ti * kTile * rp,
          product.finish(), rp, wmma::mem_row_major);
    }
    __syncthreads();
    // W has been read, and the other U and decay buffers were last read by
    // the chunk before: the next chunk's copies start (an empty group after
    // the last chunk, so that the waits count the same).
    if (chunk + 1 < chunks) {
      copy_chunk_async(
          s,
          chunk_place(a, chunk + 1).index,
          kw,
          vw,
          row0,
          ws,
          kp,
          u_buffers + ((chunk + 1) % 2) * kChunk * rp,
          rp,
          decay_buffers + ((chunk + 1) % 2) * kDecayRows * kChunk);
    }
    __pipeline_commit();
    // v' = U - W S^T, kept for chunk_output and the checkpoints, and
    // chunk_carry_state's operand decay(L-1, j) v'_j.
    for (int e = threadIdx.x; e < kChunk * kCarryRows; e += kChunkedThreads) {
      const int i = e / kCarryRows, r = e % kCarryRows;
      const float delta =
          deltas[i * rp + r] - carried[i * rp + r] - second_half[i * rp + r];
      deltas[i * rp + r] = delta;
      carried[i * rp + r] = to_end[i] * delta;
      if (r < rows) {
        u[i * vw + r] = delta;
      }
    }
    // This chunk's K has landed.
    __pipeline_wait_prior(1);
    // The sanitizer probe (tools/cuda/sanitize.sh) builds without this barrier:
    // chunk_carry_state then reads rows of K, and v' scaled for the update,
    // that other threads may not have written yet.
#ifndef GD_SANITIZER_PROBE
    __syncthreads();
#endif

    // chunk_checkpoint: the state after the first i tokens of the chunk,
    // decay(i-1, -1) S + sum_{j < i} decay(i-1, j) v'_j k_j^T, for each
    // checkpoint in the chunk (chunk_carry_state's update cut at i).
    bool checkpointed = false;
    while (next_checkpoint < a.checkpoint_count &&
           a.checkpoints[next_checkpoint] <= place.t0 + place.length) {
      const int i = a.checkpoints[next_checkpoint] - place.t0;
      float* slot = a.checkpoint_states +
          int64_t(next_checkpoint) * a.batch * a.value_heads * dv * dk +
          head_state;
#pragma unroll
      for (int y = 0; y < kRowTiles; ++y) {
        const int r = warp + 8 * y;
        float acc[kColumnsPerLane];
#pragma unroll
        for (int z = 0; z < kColumnsPerLane; ++z) {
          const int c = lane + kWarp * z;
          acc[z] = c < dk ? from_start[i - 1] * state[r * kp + c] : 0.0f;
        }
        for (int j = 0; j < i; ++j) {
          const float decay = last_wipe[i - 1] > float(j)
              ? 0.0f
              : expf(log_sum[i - 1] - log_sum[j]);
          const float d = decay * deltas[j * rp + r];
#pragma unroll
          for (int z = 0; z < kColumnsPerLane; ++z) {
            const int c = lane + kWarp * z;
            acc[z] += d * (c < dk ? ks[j * kp + c] : 0.0f);
          }
        }
        if (r < rows) {
#pragma unroll
          for (int z = 0; z < kColumnsPerLane; ++z) {
            const int c = lane + kWarp * z;
            if (c < dk) {
              slot[int64_t(row0 + r) * dk + c] = acc[z];
            }
          }
        }
      }
      ++next_checkpoint;
      checkpointed = true;
    }
    // The checkpoints read every column of the state rows they own; the
    // update below rewrites columns by warp.
    if (checkpointed) {
      __syncthreads();
    }

    // chunk_carry_state: S = decay(L-1, -1) S + sum_j decay(L-1, j) v'_j k_j^T,
    // the state's columns [16 w, 16 w + 16) in warp w's accumulator.
    if (warp * kTile < kw) {
      float* tile = state + warp * kTile;
      Product update;
      wmma::load_matrix_sync(update.sum, tile, kp, wmma::mem_row_major);
      const float last = from_start[place.length - 1];
#pragma unroll
      for (int e = 0; e < update.sum.num_elements; ++e) {
        update.sum.x[e] *= last;
      }
      for (int j0 = 0; j0 < place.length; j0 += 8) {
        update.add<wmma::col_major, wmma::row_major>(
            carried + j0 * rp, rp, ks + j0 * kp + warp * kTile, kp);
      }
      wmma::store_matrix_sync(tile, update.finish(), kp, wmma::mem_row_major);
    }
    __syncthreads();
    // K has been read: the next chunk's K starts.
    if (chunk + 1 < chunks) {
      copy_rows_async(
          s.k + (key_chunks + chunk + 1) * kChunk * kw, kw, kChunk, kw, ks, kp);
    }
    __pipeline_commit();
  }
  for (int e = threadIdx.x; e < kCarryRows * dk; e += kChunkedThreads) {
    const int r = e / dk, c = e % dk;
    if (r < rows) {
      a.state_out[head_state + int64_t(row0 + r) * dk + c] = state[r * kp + c];
    }
  }
}

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

// The entry points the executor looks up by name: gd_chunk_prepare_<dtype>,
// gd_chunk_carry (which reads only float32 scratch), gd_chunk_output_<dtype>.
#define GD_CHUNKED_ENTRIES(type, suffix)                 \
  extern "C" __global__ void __launch_bounds__(          \
      mlx_gated_delta::cuda::kChunkedThreads)            \
      gd_chunk_prepare_##suffix(                         \
          const mlx_gated_delta::cuda::CoreArgs a,       \
          const mlx_gated_delta::cuda::ChunkScratch s) { \
    mlx_gated_delta::cuda::chunk_prepare<type>(a, s);    \
  }                                                      \
  extern "C" __global__ void __launch_bounds__(          \
      mlx_gated_delta::cuda::kChunkedThreads)            \
      gd_chunk_output_##suffix(                          \
          const mlx_gated_delta::cuda::CoreArgs a,       \
          const mlx_gated_delta::cuda::ChunkScratch s) { \
    mlx_gated_delta::cuda::chunk_output<type>(a, s);     \
  }
GD_CHUNKED_ENTRIES(float, f32)
GD_CHUNKED_ENTRIES(__half, f16)
GD_CHUNKED_ENTRIES(__nv_bfloat16, bf16)
extern "C" __global__ void __launch_bounds__(
    mlx_gated_delta::cuda::kChunkedThreads, 2)
    gd_chunk_carry(
        const mlx_gated_delta::cuda::CoreArgs a,
        const mlx_gated_delta::cuda::ChunkScratch s) {
  mlx_gated_delta::cuda::chunk_carry(a, s);
}
