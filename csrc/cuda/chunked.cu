// The chunked WY form on CUDA (docs/stages.md), scalar gates, in two kernels:
//
//   chunk_prepare  one block per (chunk, value head, batch row), all chunks at
//                  once: qk_norm, gate_cumsum, k_gram, chunk_qk, kkt_inverse
//                  and recompute_w_u of one chunk, writing W, U, the decayed
//                  Q K^T and the chunk's decays to scratch (ChunkScratch).
//   chunk_carry    one block per (kCarryRows state rows, value head, batch
//                  row), the chunks in order: v' = U - W S^T, the output
//                  (chunk_output: the inter-chunk readout plus the decayed
//                  Q K^T times v'), then the next state (chunk_carry_state).
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
      x[u] = e < total ? source[(e / columns) * source_stride + e % columns] : 0.0f;
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
  place.index =
      (int64_t(place.b) * a.value_heads + place.h) * chunks + chunk;
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
    const bool active =
        i < place.length && (a.mask == nullptr || a.mask[bt]);
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
    const CoreArgs& a,
    const ChunkScratch& s) {
  extern __shared__ float shared[];
  const int dk = a.key_dim, dv = a.value_dim;
  const int kp = dk + 1, vp = dv + 1, lp = kChunk + 1;
  float* ks = shared;  // [kChunk][kp]
  float* qs = ks + kChunk * kp;  // [kChunk][kp]
  float* vs = qs + kChunk * kp;  // [kChunk][vp]
  float* as = vs + kChunk * vp;  // [kChunk][lp]: A, strictly lower
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
  const T* v = static_cast<const T*>(a.v) + (bt0 * a.value_heads + place.h) * dv;
  load_rows(k, int64_t(a.key_heads) * dk, dk, place.length, a.normalize_qk, ks, kp);
  load_rows(q, int64_t(a.key_heads) * dk, dk, place.length, a.normalize_qk, qs, kp);
  load_rows(v, int64_t(a.value_heads) * dv, dv, place.length, false, vs, vp);
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

  // kkt_inverse: (I + A) T = I by forward substitution, one column of A at a
  // time: once row m of T is final, every later row subtracts A[i][m] T[m].
  for (int m = 0; m < kChunk - 1; ++m) {
    for (int e = threadIdx.x; e < kChunk * kChunk; e += kChunkedThreads) {
      const int i = e / kChunk, j = e % kChunk;
      if (i > m && j <= m) {
        ts[i * lp + j] -= as[i * lp + m] * ts[m * lp + j];
      }
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
    float* out = s.decays + place.index * 2 * kChunk;
    out[i] = decays(i, -1);
    out[kChunk + i] = i < place.length ? decays(place.length - 1, i) : 0.0f;
  }
}

template <typename T>
__device__ __forceinline__ void chunk_carry(
    const CoreArgs& a,
    const ChunkScratch& s) {
  extern __shared__ float shared[];
  const int dk = a.key_dim, dv = a.value_dim;
  const int kp = dk + 1, lp = kChunk + 1, rp = kCarryRows + 1;
  float* state = shared;  // [kCarryRows][kp]
  float* ws = state + kCarryRows * kp;  // [kChunk][kp]
  float* ks = ws + kChunk * kp;  // [kChunk][kp]
  float* qs = ks + kChunk * kp;  // [kChunk][kp]
  float* ps = qs + kChunk * kp;  // [kChunk][lp]: decayed Q K^T
  float* deltas = ps + kChunk * lp;  // [kChunk][rp]: U, then v'
  float* from_start = deltas + kChunk * rp;
  float* to_end = from_start + kChunk;

  const int b = blockIdx.z, h = blockIdx.y;
  const int row0 = blockIdx.x * kCarryRows;
  const int kh = key_head_of(a, h);
  const int64_t head_state = (int64_t(b) * a.value_heads + h) * dv * dk;
  for (int e = threadIdx.x; e < kCarryRows * dk; e += kChunkedThreads) {
    const int r = e / dk, c = e % dk;
    state[r * kp + c] = row0 + r < dv
        ? a.state_in[head_state + int64_t(row0 + r) * dk + c]
        : 0.0f;
  }

  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  // chunk_carry / chunk_output tile: rows i = ti + 32 x, state rows
  // r = tr + 8 y.
  const int ti = threadIdx.x / 8, tr = threadIdx.x % 8;
  const int chunks = (a.tokens + kChunk - 1) / kChunk;
  T* y_all = static_cast<T*>(a.y);
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const ChunkPlace place = chunk_place(a, chunk);
    const int64_t bt0 = int64_t(b) * a.tokens + place.t0;
    const T* q = static_cast<const T*>(a.q) + (bt0 * a.key_heads + kh) * dk;
    const T* k = static_cast<const T*>(a.k) + (bt0 * a.key_heads + kh) * dk;
    load_rows(k, int64_t(a.key_heads) * dk, dk, place.length, a.normalize_qk, ks, kp);
    load_rows(q, int64_t(a.key_heads) * dk, dk, place.length, a.normalize_qk, qs, kp);
    const float* w_in = s.w + place.index * kChunk * dk;
    const float* u_in = s.u + place.index * kChunk * dv;
    const float* qk_in = s.qk + place.index * kChunk * kChunk;
    load_block(w_in, dk, kChunk, dk, ws, kp);
    load_block(qk_in, kChunk, kChunk, kChunk, ps, lp);
    // U's columns of this block's state rows (v' once chunk_carry ran).
    load_block(u_in + row0, dv, kChunk, min(kCarryRows, dv - row0), deltas, rp);
    if (threadIdx.x < 2 * kChunk) {
      const float* decays_in = s.decays + place.index * 2 * kChunk;
      (threadIdx.x < kChunk ? from_start : to_end - kChunk)[threadIdx.x] =
          decays_in[threadIdx.x];
    }
    __syncthreads();

    // chunk_carry: v' = U - W S^T and the inter-chunk readout S q_i.
    float inter[2][4] = {}, delta[2][4];
    {
      float ws_acc[2][4] = {};
      for (int c = 0; c < dk; ++c) {
        float sr[4];
#pragma unroll
        for (int y = 0; y < 4; ++y) {
          sr[y] = state[(tr + 8 * y) * kp + c];
        }
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const float wi = ws[(ti + 32 * x) * kp + c];
          const float qi = qs[(ti + 32 * x) * kp + c];
#pragma unroll
          for (int y = 0; y < 4; ++y) {
            ws_acc[x][y] += wi * sr[y];
            inter[x][y] += qi * sr[y];
          }
        }
      }
#pragma unroll
      for (int x = 0; x < 2; ++x) {
#pragma unroll
        for (int y = 0; y < 4; ++y) {
          float* cell = &deltas[(ti + 32 * x) * rp + tr + 8 * y];
          delta[x][y] = *cell - ws_acc[x][y];
          *cell = delta[x][y];
        }
      }
    }
    // The sanitizer probe (tools/cuda/sanitize.sh) builds without this barrier:
    // chunk_output then reads v' that other threads may not have written yet.
#ifndef GD_SANITIZER_PROBE
    __syncthreads();
#endif

    // chunk_output: y_i = scale (decay(i, -1) S q_i + sum_{j <= i} P_ij v'_j),
    // 0 where masked.
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const int i = ti + 32 * x;
      float intra[4] = {};
      for (int j = 0; j <= i; ++j) {
        const float p = ps[i * lp + j];
#pragma unroll
        for (int y = 0; y < 4; ++y) {
          intra[y] += p * deltas[j * rp + tr + 8 * y];
        }
      }
      if (i < place.length) {
        const int64_t bt = bt0 + i;
        const bool active = a.mask == nullptr || a.mask[bt];
        T* y_row = y_all + (bt * a.value_heads + h) * dv;
#pragma unroll
        for (int y = 0; y < 4; ++y) {
          const int r = row0 + tr + 8 * y;
          if (r < dv) {
            const float out =
                a.scale * (from_start[i] * inter[x][y] + intra[y]);
            y_row[r] = from_float<T>(active ? out : 0.0f);
          }
        }
      }
    }

    // chunk_carry_state: S = decay(L-1, -1) S + sum_j decay(L-1, j) v'_j k_j^T;
    // state rows r = warp + 8 y, columns c = lane + 32 z.
    {
      const float last = from_start[place.length - 1];
      float acc[4][4];
#pragma unroll
      for (int y = 0; y < 4; ++y) {
#pragma unroll
        for (int z = 0; z < 4; ++z) {
          const int c = lane + kWarp * z;
          acc[y][z] = c < dk ? last * state[(warp + 8 * y) * kp + c] : 0.0f;
        }
      }
      for (int j = 0; j < place.length; ++j) {
        float kj[4];
#pragma unroll
        for (int z = 0; z < 4; ++z) {
          const int c = lane + kWarp * z;
          kj[z] = c < dk ? ks[j * kp + c] : 0.0f;
        }
#pragma unroll
        for (int y = 0; y < 4; ++y) {
          const float d = to_end[j] * deltas[j * rp + warp + 8 * y];
#pragma unroll
          for (int z = 0; z < 4; ++z) {
            acc[y][z] += d * kj[z];
          }
        }
      }
#pragma unroll
      for (int y = 0; y < 4; ++y) {
#pragma unroll
        for (int z = 0; z < 4; ++z) {
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
    if (row0 + r < dv) {
      a.state_out[head_state + int64_t(row0 + r) * dk + c] = state[r * kp + c];
    }
  }
}

}  // namespace

}  // namespace mlx_gated_delta::cuda

// The entry points the executor looks up by name: gd_chunk_prepare_<dtype>,
// gd_chunk_carry_<dtype>.
#define GD_CHUNKED_ENTRIES(type, suffix)                                    \
  extern "C" __global__ void __launch_bounds__(                             \
      mlx_gated_delta::cuda::kChunkedThreads)                               \
      gd_chunk_prepare_##suffix(                                            \
          const mlx_gated_delta::cuda::CoreArgs a,                          \
          const mlx_gated_delta::cuda::ChunkScratch s) {                    \
    mlx_gated_delta::cuda::chunk_prepare<type>(a, s);                       \
  }                                                                         \
  extern "C" __global__ void __launch_bounds__(                             \
      mlx_gated_delta::cuda::kChunkedThreads)                               \
      gd_chunk_carry_##suffix(                                              \
          const mlx_gated_delta::cuda::CoreArgs a,                          \
          const mlx_gated_delta::cuda::ChunkScratch s) {                    \
    mlx_gated_delta::cuda::chunk_carry<type>(a, s);                         \
  }
GD_CHUNKED_ENTRIES(float, f32)
GD_CHUNKED_ENTRIES(__half, f16)
GD_CHUNKED_ENTRIES(__nv_bfloat16, bf16)
