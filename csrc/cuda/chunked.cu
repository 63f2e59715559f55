// The chunked WY form on CUDA (docs/stages.md), scalar gates, in three
// kernels:
//
//   chunk_prepare  one block per (chunk, value head, batch row), all chunks at
//                  once: qk_norm, gate_cumsum, k_gram, chunk_qk, kkt_inverse
//                  and recompute_w_u of one chunk, writing W, U, the decayed
//                  Q K^T and the chunk's decays to scratch (ChunkScratch).
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
// Everything is float32 in shared memory (rows padded by one float so that a
// column walk touches 32 banks); products are register-tiled FMA loops.
#include "cuda/device_common.cuh"
#include "cuda/launch_shapes.h"

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

// Loads rows [0, kChunk) of a [T, heads, dim] activation at token t0 and head
// `head` into shared rows of stride `stride`, zero past the chunk's `length`
// tokens, L2-normalised with `normalize`. Each warp takes kRowsPerLoad rows
// at a time and issues all their loads before the first use (the loads'
// latency, not their bytes, bounds this step); lane holds columns
// lane + 32 j of a row, dim <= kChunkedMaxDim.
constexpr int kRowsPerLoad = 4;
constexpr int kColumnsPerLane = kChunkedMaxDim / kWarp;

template <typename T>
__device__ void load_rows(
    const T* source,
    int64_t token_stride,
    int dim,
    int length,
    bool normalize,
    float* rows,
    int stride) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  constexpr int warps = kChunkedThreads / kWarp;
  for (int i0 = warp * kRowsPerLoad; i0 < kChunk; i0 += warps * kRowsPerLoad) {
    float x[kRowsPerLoad][kColumnsPerLane];
#pragma unroll
    for (int r = 0; r < kRowsPerLoad; ++r) {
#pragma unroll
      for (int j = 0; j < kColumnsPerLane; ++j) {
        const int c = lane + kWarp * j;
        x[r][j] = (i0 + r < length && c < dim)
            ? to_float(source[(i0 + r) * token_stride + c])
            : 0.0f;
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPerLoad; ++r) {
      float scale = 1.0f;
      if (normalize) {
        float squares = 0.0f;
#pragma unroll
        for (int j = 0; j < kColumnsPerLane; ++j) {
          squares += x[r][j] * x[r][j];
        }
        scale = i0 + r < length ? inverse_norm(warp_sum(squares)) : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kColumnsPerLane; ++j) {
        const int c = lane + kWarp * j;
        if (c < dim) {
          rows[(i0 + r) * stride + c] = x[r][j] * scale;
        }
      }
    }
  }
}

// Copies a row-major [rows, columns] float32 block of scratch (row stride
// `source_stride`) into shared rows of stride `stride`, kInFlight loads per
// thread issued before their stores.
__device__ void load_block(
    const float* source,
    int64_t source_stride,
    int rows,
    int columns,
    float* shared_rows,
    int stride) {
  constexpr int kInFlight = 8;
  const int total = rows * columns;
  for (int base = 0; base < total; base += kChunkedThreads * kInFlight) {
    float x[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int e = base + u * kChunkedThreads + threadIdx.x;
      x[u] = e < total ? source[(e / columns) * source_stride + e % columns]
                       : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int e = base + u * kChunkedThreads + threadIdx.x;
      if (e < total) {
        shared_rows[(e / columns) * stride + e % columns] = x[u];
      }
    }
  }
}

// Copies `count` consecutive floats of scratch, which hold rows of `columns`
// floats, into shared rows of stride `stride`: 16-byte loads where the block
// is 16-byte aligned and count a multiple of 4 (load_block otherwise),
// kInFlight of them per thread issued before their stores.
__device__ void load_contiguous(
    const float* source, int count, int columns, float* shared_rows,
    int stride) {
  if (reinterpret_cast<uintptr_t>(source) % 16 != 0 || count % 4 != 0) {
    load_block(source, columns, count / columns, columns, shared_rows, stride);
    return;
  }
  constexpr int kInFlight = 4;
  const float4* source4 = reinterpret_cast<const float4*>(source);
  const int total4 = count / 4;
  for (int base = 0; base < total4; base += kChunkedThreads * kInFlight) {
    float4 x[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int e = base + u * kChunkedThreads + threadIdx.x;
      x[u] = e < total4 ? source4[e] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int e = 4 * (base + u * kChunkedThreads + threadIdx.x);
      if (e < count) {
        const float values[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          shared_rows[((e + w) / columns) * stride + (e + w) % columns] =
              values[w];
        }
      }
    }
  }
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
  extern __shared__ float shared[];
  const int dk = a.key_dim, dv = a.value_dim;
  const int kp = dk + 1, vp = dv + 1, lp = kChunk + 1;
  float* ks = shared;  // [kChunk][kp]
  // Q [kChunk][kp] for chunk_qk, then V [kChunk][vp] for recompute_w_u: one
  // buffer, so that two blocks fit in a multiprocessor's shared memory.
  float* qs = ks + kChunk * kp;
  float* vs = qs;
  float* as = qs + kChunk * max(kp, vp);  // [kChunk][lp]: A, strictly lower
  float* ts = as + kChunk * lp;  // [kChunk][lp]: T = (I + A)^-1
  float* gates = ts + kChunk * lp;
  float* betas = gates + kChunk;
  float* log_sum = betas + kChunk;
  float* coefficient = log_sum + kChunk;  // beta_j decay(j, -1)
  int* last_wipe = reinterpret_cast<int*>(coefficient + kChunk);
  const ChunkGates decays{log_sum, last_wipe};

  const ChunkPlace place = chunk_place(a, blockIdx.x);
  gate_cumsum(a, place, gates, betas, decays);

  const int kh = key_head_of(a, place.h);
  const int64_t bt0 = int64_t(place.b) * a.tokens + place.t0;
  const T* q = static_cast<const T*>(a.q) + (bt0 * a.key_heads + kh) * dk;
  const T* k = static_cast<const T*>(a.k) + (bt0 * a.key_heads + kh) * dk;
  const T* v =
      static_cast<const T*>(a.v) + (bt0 * a.value_heads + place.h) * dv;
  load_rows(
      k, int64_t(a.key_heads) * dk, dk, place.length, a.normalize_qk, ks, kp);
  load_rows(
      q, int64_t(a.key_heads) * dk, dk, place.length, a.normalize_qk, qs, kp);
  __syncthreads();

  // k_gram and chunk_qk: 4 x 4 tiles, rows i = 4 ti + x, columns j = tj + 16 y.
  {
    const int ti = threadIdx.x / 16, tj = threadIdx.x % 16;
    float kk[4][4] = {}, qk[4][4] = {};
    for (int c = 0; c < dk; ++c) {
      float kj[4];
#pragma unroll
      for (int y = 0; y < 4; ++y) {
        kj[y] = ks[(tj + 16 * y) * kp + c];
      }
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const float ki = ks[(4 * ti + x) * kp + c];
        const float qi = qs[(4 * ti + x) * kp + c];
#pragma unroll
        for (int y = 0; y < 4; ++y) {
          kk[x][y] += ki * kj[y];
          qk[x][y] += qi * kj[y];
        }
      }
    }
    float* qk_out = s.qk + place.index * kChunk * kChunk;
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int i = 4 * ti + x;
#pragma unroll
      for (int y = 0; y < 4; ++y) {
        const int j = tj + 16 * y;
        const float decay = j <= i ? decays(i, j) : 0.0f;
        // kkt_inverse's A (strictly lower) and T's start, the identity.
        as[i * lp + j] = j < i ? betas[i] * decay * kk[x][y] : 0.0f;
        ts[i * lp + j] = i == j ? 1.0f : 0.0f;
        qk_out[i * kChunk + j] = decay * qk[x][y];
      }
    }
  }
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    coefficient[i] = betas[i] * decays(i, -1);
  }
  __syncthreads();
  // Q has been read: V takes its buffer (the barriers of kkt_inverse order
  // these writes before recompute_w_u reads them).
  load_rows(v, int64_t(a.value_heads) * dv, dv, place.length, false, vs, vp);

  // kkt_inverse: (I + A) T = I by forward substitution, one column of A at a
  // time: once row m of T is final, every later row i > m subtracts
  // A[i][m] T[m][j] (j <= m, where row m is not zero).
  for (int m = 0; m < kChunk - 1; ++m) {
    const int width = m + 1;
    for (int e = threadIdx.x; e < (kChunk - 1 - m) * width;
         e += kChunkedThreads) {
      const int i = m + 1 + e / width, j = e % width;
      ts[i * lp + j] -= as[i * lp + m] * ts[m * lp + j];
    }
    __syncthreads();
  }

  // recompute_w_u: W = T diag(beta decay(i, -1)) K, U = T diag(beta) V; rows
  // i = warp + 8 x, columns c = lane + 32 y.
  {
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
    float w[8][4] = {}, u[8][4] = {};
    for (int j = 0; j < kChunk; ++j) {
      float kj[4], vj[4];
#pragma unroll
      for (int y = 0; y < 4; ++y) {
        const int c = lane + kWarp * y;
        kj[y] = c < dk ? ks[j * kp + c] * coefficient[j] : 0.0f;
        vj[y] = c < dv ? vs[j * vp + c] * betas[j] : 0.0f;
      }
#pragma unroll
      for (int x = 0; x < 8; ++x) {
        const float t = ts[(warp + 8 * x) * lp + j];
#pragma unroll
        for (int y = 0; y < 4; ++y) {
          w[x][y] += t * kj[y];
          u[x][y] += t * vj[y];
        }
      }
    }
    float* w_out = s.w + place.index * kChunk * dk;
    float* u_out = s.u + place.index * kChunk * dv;
#pragma unroll
    for (int x = 0; x < 8; ++x) {
      const int i = warp + 8 * x;
#pragma unroll
      for (int y = 0; y < 4; ++y) {
        const int c = lane + kWarp * y;
        if (c < dk) {
          w_out[i * dk + c] = w[x][y];
        }
        if (c < dv) {
          u_out[i * dv + c] = u[x][y];
        }
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
  }
}

// What chunk_carry reads of one chunk's scratch, W [kChunk, Dk], the U tile
// [kChunk, kCarryRows] and the decays, held in registers: fetched during the
// previous chunk's update (the loads are in flight while it computes), stored
// to shared memory when the chunk starts.
struct CarryTiles {
  static constexpr int kW4 = kChunk * kChunkedMaxDim / 4 / kChunkedThreads;
  static constexpr int kU = kChunk * kCarryRows / kChunkedThreads;
  static_assert(kDecayRows * kChunk == kChunkedThreads, "one decay a thread");
  float4 w[kW4];
  float u[kU];
  float decay;

  __device__ void fetch(
      const ChunkScratch& s, int64_t index, int dk, int dv, int row0,
      int rows) {
    // W is kChunk * dk consecutive floats, 16-byte aligned (dk * kChunk is
    // a multiple of 4).
    const float4* w4 = reinterpret_cast<const float4*>(s.w + index * kChunk * dk);
#pragma unroll
    for (int m = 0; m < kW4; ++m) {
      const int e = m * kChunkedThreads + threadIdx.x;
      w[m] = 4 * e < kChunk * dk ? w4[e] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    const float* u_tile = s.u + index * kChunk * dv + row0;
#pragma unroll
    for (int m = 0; m < kU; ++m) {
      const int e = m * kChunkedThreads + threadIdx.x;
      const int i = e / kCarryRows, r = e % kCarryRows;
      u[m] = r < rows ? u_tile[i * dv + r] : 0.0f;
    }
    decay = s.decays[index * kDecayRows * kChunk + threadIdx.x];
  }

  __device__ void store(
      int dk, float* wk, int kp, float* deltas, int rp, float* decays) const {
#pragma unroll
    for (int m = 0; m < kW4; ++m) {
      const int e = 4 * (m * kChunkedThreads + threadIdx.x);
      if (e < kChunk * dk) {
        const float values[4] = {w[m].x, w[m].y, w[m].z, w[m].w};
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          wk[((e + v) / dk) * kp + (e + v) % dk] = values[v];
        }
      }
    }
#pragma unroll
    for (int m = 0; m < kU; ++m) {
      const int e = m * kChunkedThreads + threadIdx.x;
      deltas[(e / kCarryRows) * rp + e % kCarryRows] = u[m];
    }
    decays[threadIdx.x] = decay;
  }
};

// chunk_carry: the only sequential pass. Per chunk it reads W, U, K and the
// decays and does no more than the chain needs: v' = U - W S^T (written over
// U), the state at the chunk's start (ChunkScratch::h) for chunk_output, the
// checkpoints and the next state. Tiles: v' gives each thread token rows
// i = ti + 32 x (x < 2) and state rows r = tr + 8 y (y < kRowTiles);
// chunk_checkpoint and chunk_carry_state state rows r = warp + 8 y and columns
// c = lane + 32 z.
template <typename T>
__device__ __forceinline__ void chunk_carry(
    const CoreArgs& a, const ChunkScratch& s) {
  constexpr int kRowTiles = kCarryRows / 8;
  extern __shared__ float shared[];
  const int dk = a.key_dim, dv = a.value_dim;
  const int kp = dk + 1, rp = kCarryRows + 1;
  float* state = shared;  // [kCarryRows][kp]
  // W [kChunk][kp] for v', then K for chunk_carry_state: one buffer.
  float* wk = state + kCarryRows * kp;
  float* deltas = wk + kChunk * kp;  // [kChunk][rp]: U, then v'
  // The chunk's decays (ChunkScratch): from_start, to_end, then the
  // cumulative logs and last wipes of chunk_checkpoint's decay(i - 1, j).
  float* from_start = deltas + kChunk * rp;
  float* to_end = from_start + kChunk;
  float* log_sum = to_end + kChunk;
  float* last_wipe = log_sum + kChunk;

  const int b = blockIdx.z, h = blockIdx.y;
  const int row0 = blockIdx.x * kCarryRows;
  const int rows = min(kCarryRows, dv - row0);
  const int kh = key_head_of(a, h);
  const int64_t head_state = (int64_t(b) * a.value_heads + h) * dv * dk;
  for (int e = threadIdx.x; e < kCarryRows * dk; e += kChunkedThreads) {
    const int r = e / dk, c = e % dk;
    state[r * kp + c] =
        r < rows ? a.state_in[head_state + int64_t(row0 + r) * dk + c] : 0.0f;
  }
  // Columns of U past the last state row stay 0 (the last block of a Dv
  // that is not a multiple of kCarryRows).
  for (int e = threadIdx.x; e < kChunk * rp; e += kChunkedThreads) {
    deltas[e] = 0.0f;
  }
  __syncthreads();

  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int ti = threadIdx.x / 8, tr = threadIdx.x % 8;
  const int chunks = (a.tokens + kChunk - 1) / kChunk;
  int next_checkpoint = 0;
  CarryTiles next;
  next.fetch(s, chunk_place(a, 0).index, dk, dv, row0, rows);
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const ChunkPlace place = chunk_place(a, chunk);
    const int64_t bt0 = int64_t(b) * a.tokens + place.t0;
    const T* k = static_cast<const T*>(a.k) + (bt0 * a.key_heads + kh) * dk;
    float* u = s.u + place.index * kChunk * dv + row0;
    next.store(dk, wk, kp, deltas, rp, from_start);
    // The state at the chunk's start, for chunk_output.
    float* h_out = s.h + place.index * dv * dk + int64_t(row0) * dk;
    for (int e = threadIdx.x; e < rows * dk; e += kChunkedThreads) {
      const int r = e / dk, c = e % dk;
      h_out[int64_t(r) * dk + c] = state[r * kp + c];
    }
    __syncthreads();

    // chunk_carry: v' = U - W S^T.
    {
      float ws_acc[2][kRowTiles] = {};
      for (int c = 0; c < dk; ++c) {
        float sr[kRowTiles];
#pragma unroll
        for (int y = 0; y < kRowTiles; ++y) {
          sr[y] = state[(tr + 8 * y) * kp + c];
        }
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const float wi = wk[(ti + 32 * x) * kp + c];
#pragma unroll
          for (int y = 0; y < kRowTiles; ++y) {
            ws_acc[x][y] += wi * sr[y];
          }
        }
      }
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int i = ti + 32 * x;
#pragma unroll
        for (int y = 0; y < kRowTiles; ++y) {
          const int r = tr + 8 * y;
          const float delta = deltas[i * rp + r] - ws_acc[x][y];
          deltas[i * rp + r] = delta;
          if (r < rows) {
            u[i * dv + r] = delta;
          }
        }
      }
    }
    __syncthreads();
    // W has been read: K takes its buffer.
    load_rows(
        k, int64_t(a.key_heads) * dk, dk, place.length, a.normalize_qk, wk, kp);
    // The next chunk's tiles: in flight while this chunk's state is updated.
    if (chunk + 1 < chunks) {
      next.fetch(s, chunk_place(a, chunk + 1).index, dk, dv, row0, rows);
    }
    // The sanitizer probe (tools/cuda/sanitize.sh) builds without this barrier:
    // chunk_carry_state then reads rows of K that other warps may not have
    // written yet.
#ifndef GD_SANITIZER_PROBE
    __syncthreads();
#endif

    // chunk_checkpoint: the state after the first i tokens of the chunk,
    // decay(i-1, -1) S + sum_{j < i} decay(i-1, j) v'_j k_j^T, for each
    // checkpoint in the chunk (chunk_carry_state's update cut at i).
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
            acc[z] += d * (c < dk ? wk[j * kp + c] : 0.0f);
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
    }

    // chunk_carry_state: S = decay(L-1, -1) S + sum_j decay(L-1, j) v'_j k_j^T.
    {
      const float last = from_start[place.length - 1];
      float acc[kRowTiles][kColumnsPerLane];
#pragma unroll
      for (int y = 0; y < kRowTiles; ++y) {
#pragma unroll
        for (int z = 0; z < kColumnsPerLane; ++z) {
          const int c = lane + kWarp * z;
          acc[y][z] = c < dk ? last * state[(warp + 8 * y) * kp + c] : 0.0f;
        }
      }
      for (int j = 0; j < place.length; ++j) {
        float kj[kColumnsPerLane];
#pragma unroll
        for (int z = 0; z < kColumnsPerLane; ++z) {
          const int c = lane + kWarp * z;
          kj[z] = c < dk ? wk[j * kp + c] : 0.0f;
        }
#pragma unroll
        for (int y = 0; y < kRowTiles; ++y) {
          const float d = to_end[j] * deltas[j * rp + warp + 8 * y];
#pragma unroll
          for (int z = 0; z < kColumnsPerLane; ++z) {
            acc[y][z] += d * kj[z];
          }
        }
      }
#pragma unroll
      for (int y = 0; y < kRowTiles; ++y) {
#pragma unroll
        for (int z = 0; z < kColumnsPerLane; ++z) {
          const int c = lane + kWarp * z;
          if (c < dk) {
            state[(warp + 8 * y) * kp + c] = acc[y][z];
          }
        }
      }
    }
    __syncthreads();
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
// and v' that chunk_carry wrote. Tiles: token rows i = ti + 32 x (x < 2),
// value columns r = tr + 8 y (y < kOutputRows / 8).
template <typename T>
__device__ __forceinline__ void chunk_output(
    const CoreArgs& a, const ChunkScratch& s) {
  constexpr int kRowTiles = kOutputRows / 8;
  extern __shared__ float shared[];
  const int dk = a.key_dim, dv = a.value_dim;
  const int kp = dk + 1, lp = kChunk + 1, rp = kOutputRows + 1;
  float* qs = shared;  // [kChunk][kp]
  float* ps = qs + kChunk * kp;  // [kChunk][lp]: decayed Q K^T
  float* hs = ps + kChunk * lp;  // [kOutputRows][kp]: S's rows
  float* deltas = hs + kOutputRows * kp;  // [kChunk][rp]: v'
  float* from_start = deltas + kChunk * rp;  // [kChunk]

  const int tiles = (dv + kOutputRows - 1) / kOutputRows;
  const ChunkPlace place = chunk_place(a, blockIdx.x / tiles);
  const int row0 = (blockIdx.x % tiles) * kOutputRows;
  const int rows = min(kOutputRows, dv - row0);
  const int kh = key_head_of(a, place.h);
  const int64_t bt0 = int64_t(place.b) * a.tokens + place.t0;
  const T* q = static_cast<const T*>(a.q) + (bt0 * a.key_heads + kh) * dk;
  load_rows(
      q, int64_t(a.key_heads) * dk, dk, place.length, a.normalize_qk, qs, kp);
  load_contiguous(s.qk + place.index * kChunk * kChunk, kChunk * kChunk, kChunk,
      ps, lp);
  load_contiguous(
      s.h + place.index * dv * dk + int64_t(row0) * dk, rows * dk, dk, hs, kp);
  load_block(
      s.u + place.index * kChunk * dv + row0, dv, kChunk, rows, deltas, rp);
  for (int e = threadIdx.x; e < kRowTiles * 8 - rows; e += kChunkedThreads) {
    // Rows of S past Dv (the last tile of a Dv that is not a multiple of
    // kOutputRows) are 0; so are their v' columns.
    for (int c = 0; c < dk; ++c) {
      hs[(rows + e) * kp + c] = 0.0f;
    }
    for (int i = 0; i < kChunk; ++i) {
      deltas[i * rp + rows + e] = 0.0f;
    }
  }
  if (threadIdx.x < kChunk) {
    from_start[threadIdx.x] =
        s.decays[place.index * kDecayRows * kChunk + threadIdx.x];
  }
  __syncthreads();

  const int ti = threadIdx.x / 8, tr = threadIdx.x % 8;
  float acc[2][kRowTiles] = {};
  for (int c = 0; c < dk; ++c) {
    float sr[kRowTiles];
#pragma unroll
    for (int y = 0; y < kRowTiles; ++y) {
      sr[y] = hs[(tr + 8 * y) * kp + c];
    }
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const float qi = qs[(ti + 32 * x) * kp + c];
#pragma unroll
      for (int y = 0; y < kRowTiles; ++y) {
        acc[x][y] += qi * sr[y];
      }
    }
  }
  T* y_all = static_cast<T*>(a.y);
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int i = ti + 32 * x;
    float intra[kRowTiles] = {};
    for (int j = 0; j <= i; ++j) {
      const float p = ps[i * lp + j];
#pragma unroll
      for (int y = 0; y < kRowTiles; ++y) {
        intra[y] += p * deltas[j * rp + tr + 8 * y];
      }
    }
    if (i < place.length) {
      const int64_t bt = bt0 + i;
      const bool active = a.mask == nullptr || a.mask[bt];
      T* y_row = y_all + (bt * a.value_heads + place.h) * dv + row0;
#pragma unroll
      for (int y = 0; y < kRowTiles; ++y) {
        const int r = tr + 8 * y;
        if (r < rows) {
          const float out = a.scale * (from_start[i] * acc[x][y] + intra[y]);
          y_row[r] = from_float<T>(active ? out : 0.0f);
        }
      }
    }
  }
}

}  // namespace

}  // namespace mlx_gated_delta::cuda

// The entry points the executor looks up by name: gd_chunk_prepare_<dtype>,
// gd_chunk_carry_<dtype>, gd_chunk_output_<dtype>.
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
      gd_chunk_carry_##suffix(                           \
          const mlx_gated_delta::cuda::CoreArgs a,       \
          const mlx_gated_delta::cuda::ChunkScratch s) { \
    mlx_gated_delta::cuda::chunk_carry<type>(a, s);      \
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
