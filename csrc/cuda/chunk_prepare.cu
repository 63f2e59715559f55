// chunk_prepare: the chunked form's per-chunk stages before the sequential
// pass (chunked_common.cuh), every chunk at once.
#include "cuda/chunked_common.cuh"

namespace mlx_gated_delta::cuda {

namespace {

constexpr float kLog2E = 1.4426950408889634f;
// The largest change of a column's log2 sum within a row tile, from the
// tile's reference row (relative_rows), at which the tile's diagonal block
// runs on tensor cores (diagonal_block_grams): its column factors reach
// 2^(2 * 32) and its row factors 2^-32, so that a row of K stays a normal
// float for |k| above 1e-28, and the rest of the way the block's terms take
// float32's rounding of themselves.
constexpr float kTileProductLog2Limit = 32.0f;

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

// The per-key gates' gate_cumsum (kernel_args.h): for each key column c its
// cumulative log2 decay over the finite gates, log2_sums[i][c], and the last
// wipe at or before token i, last_wipes[i][c] (-1: none); channel c's decay
// from token j to token i is ChannelGates{...}(c, i, j), as ChunkGates' for
// one column. Rows are a token's, `stride` apart (K's shared rows' stride),
// so that the decays of four consecutive columns are one vector load; the
// columns past Dk hold 0 (no decay, no wipe). Base-2 sums: each decay is one
// exp2f of a difference.
struct ChannelGates {
  float* log2_sums;  // [kChunk][stride]
  signed char* last_wipes;  // [kChunk][stride]
  int stride;
  bool wipes;  // whether any column of the chunk has one
  // No wipe, and no column's log2 sum moves by more than
  // kTileProductLog2Limit within a row tile from its reference row.
  bool tile_products;

  __device__ float operator()(int c, int i, int j) const {
    if (wipes && last_wipes[i * stride + c] > j) {
      return 0.0f;
    }
    return exp2f(
        log2_sums[i * stride + c] -
        (j >= 0 ? log2_sums[j * stride + c] : 0.0f));
  }

  // Columns c to c + 3 at once (c a multiple of 4): vector loads.
  __device__ float4 four(int c, int i, int j) const {
    const float4 to =
        *reinterpret_cast<const float4*>(log2_sums + i * stride + c);
    const float4 from = j >= 0
        ? *reinterpret_cast<const float4*>(log2_sums + j * stride + c)
        : float4{0.0f, 0.0f, 0.0f, 0.0f};
    float4 decay{
        exp2f(to.x - from.x),
        exp2f(to.y - from.y),
        exp2f(to.z - from.z),
        exp2f(to.w - from.w)};
    if (wipes) {
      const char4 last =
          *reinterpret_cast<const char4*>(last_wipes + i * stride + c);
      decay.x = last.x > j ? 0.0f : decay.x;
      decay.y = last.y > j ? 0.0f : decay.y;
      decay.z = last.z > j ? 0.0f : decay.z;
      decay.w = last.w > j ? 0.0f : decay.w;
    }
    return decay;
  }

  // 1 / decay_c(j, m)^2 for columns c to c + 3, m < j, in a chunk without
  // wipes: the factor that takes a row decayed from m to one grown from j.
  __device__ float4 inverse_squared(int c, int j, int m) const {
    const float4 to = m >= 0
        ? *reinterpret_cast<const float4*>(log2_sums + m * stride + c)
        : float4{0.0f, 0.0f, 0.0f, 0.0f};
    const float4 from =
        *reinterpret_cast<const float4*>(log2_sums + j * stride + c);
    return {
        exp2f(2.0f * (to.x - from.x)),
        exp2f(2.0f * (to.y - from.y)),
        exp2f(2.0f * (to.z - from.z)),
        exp2f(2.0f * (to.w - from.w))};
  }
};

__device__ inline float4 load4(const float* at) {
  return *reinterpret_cast<const float4*>(at);
}
__device__ inline void store4(float* at, float4 x) {
  *reinterpret_cast<float4*>(at) = x;
}
__device__ inline float4 operator*(float4 x, float4 y) {
  return {x.x * y.x, x.y * y.y, x.z * y.z, x.w * y.w};
}
__device__ inline float4 operator*(float4 x, float y) {
  return {x.x * y, x.y * y, x.z * y, x.w * y};
}
__device__ inline float dot(float4 x, float4 y) {
  return x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
}

// Every thread of the block calls it: it also sets decays.wipes and
// decays.tile_products.
__device__ void channel_gate_cumsum(
    const CoreArgs& a, const ChunkPlace& place, ChannelGates& decays) {
  // The chunk's gates into log2_sums first, every load issued at once (a
  // column's scan would wait for each of its 64 in turn), 0 where masked, past
  // the chunk or past Dk. The wipe test is on the gate as given, as
  // gate_cumsum's.
  const int dk = a.key_dim, kw = tile_padded(dk);
  const int64_t bt0 = int64_t(place.b) * a.tokens + place.t0;
  for (int e = threadIdx.x; e < kChunk * kw; e += kChunkedThreads) {
    const int t = e / kw, c = e % kw;
    const bool active =
        c < dk && t < place.length && (a.mask == nullptr || a.mask[bt0 + t]);
    decays.log2_sums[t * decays.stride + c] =
        active ? a.g[((bt0 + t) * a.value_heads + place.h) * dk + c] : 0.0f;
  }
  __syncthreads();
  const int c = threadIdx.x;
  int wipe_at = -1;
  // The largest |sum - reference| in a row tile, the reference the sum
  // before the tile (0 before the chunk).
  float reference = 0.0f, moved = 0.0f;
  if (c < kw) {
    float sum = 0.0f;
    for (int t = 0; t < kChunk; ++t) {
      const int at = t * decays.stride + c;
      const float gate = decays.log2_sums[at];
      const bool wipe = expf(gate) == 0.0f;
      sum += wipe ? 0.0f : gate * kLog2E;
      wipe_at = wipe ? t : wipe_at;
      decays.log2_sums[at] = sum;
      decays.last_wipes[at] = static_cast<signed char>(wipe_at);
      moved = fmaxf(moved, fabsf(sum - reference));
      reference = t % kTile == kTile - 1 ? sum : reference;
    }
  }
  decays.wipes = __syncthreads_or(wipe_at >= 0) != 0;
  const bool within = __syncthreads_and(moved <= kTileProductLog2Limit) != 0;
  decays.tile_products = within && !decays.wipes;
}

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
    // Per-key gates decay by key column (channel_gate_cumsum): the chunk's
    // scalar decays are all 1.
    gates[i] = active && a.per_key_gates == 0 ? a.g[gate] : 0.0f;
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

// The per-key gates' k_gram, chunk_qk and kkt_inverse's A with their decays
// (docs/numerics.md, "Per-key-channel gates in the chunked form"): entry
// (i, j), j <= i, of K K^T and Q K^T sums k_ic decay_c(i, j) k_jc (q_ic for
// Q K^T) over the key columns c. Every factor is a decay of at most 1, so no
// product overflows at any gate size:
//   the 16 x 16 diagonal blocks pair by pair (channel_diagonal_grams), each
//   decay the exp2 of a difference of log2 sums;
//   the blocks left of them on tensor cores, each side's rows decayed to or
//   from the last row m = 16 ti - 1 before row tile ti, decay_c(i, j) =
//   decay_c(i, m) decay_c(m, j) for j <= m < i (relative_rows, then
//   relative_block_grams).
// Then A and the decayed Q K^T take their scales (scale_grams).

// The diagonal blocks: thread t the entry (t / 16, t % 16) of each of the
// four, four independent sums over the key columns four at a time (the rows'
// padded columns are 0 in K and Q, and their decays are 1); into A's and T's
// buffers as they are (unscaled, 0 above the diagonal).
__device__ void channel_diagonal_grams(
    int kw,
    ChannelGates decays,
    const float* ks,
    const float* qs,
    int kp,
    float* as,
    float* ts,
    int lp) {
  constexpr int kBlocks = kChunk / kTile;
  static_assert(kTile * kTile == kChunkedThreads, "an entry of each a thread");
  const int li = threadIdx.x / kTile, lj = threadIdx.x % kTile;
  float kk[kBlocks] = {}, qk[kBlocks] = {};
  if (lj <= li) {
    for (int c = 0; c < kw; c += 4) {
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        const int i = b * kTile + li, j = b * kTile + lj;
        const float4 key_j = load4(ks + j * kp + c) * decays.four(c, i, j);
        kk[b] += dot(load4(ks + i * kp + c), key_j);
        qk[b] += dot(load4(qs + i * kp + c), key_j);
      }
    }
  }
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
    const int at = (b * kTile + li) * lp + b * kTile + lj;
    as[at] = kk[b];
    ts[at] = qk[b];
  }
}

// Rows decayed relative to each row tile's reference row m = 16 ti - 1 for
// the blocks left of the diagonal: into `columns`, for ti = 1, 2, 3 in turn
// (16 ti rows from relative_column_row(ti) on), k_jc decay_c(m, j) for
// j <= m; in place, rows i of K and Q times decay_c(i, m) (row tile 0 from
// the chunk's start, m = -1). Columns past Dk stay 0 (so they are in K and
// Q). The column rows read K as
// it was: a barrier between the two loops. Lane l takes columns 4 l to
// 4 l + 3 of every eighth row (kw is at most 128).
__device__ inline int relative_column_row(int ti) {
  return (ti - 1) * ti / 2 * kTile;
}

__device__ void relative_rows(
    int kw, ChannelGates decays, float* ks, float* qs, int kp, float* columns) {
  constexpr int kWarps = kChunkedThreads / kWarp;
  const int warp = threadIdx.x / kWarp, c = 4 * (threadIdx.x % kWarp);
  if (c < kw) {
    for (int row = warp; row < kRelativeColumnRows; row += kWarps) {
      // The tile ti whose block of rows this is: 16, 32 and 48 rows.
      const int ti = row < kTile ? 1 : (row < 3 * kTile ? 2 : 3);
      const int j = row - relative_column_row(ti);
      store4(
          columns + row * kp + c,
          load4(ks + j * kp + c) * decays.four(c, kTile * ti - 1, j));
    }
  }
  __syncthreads();
  if (c < kw) {
    for (int i = warp; i < kChunk; i += kWarps) {
      const float4 decay = decays.four(c, i, i / kTile * kTile - 1);
      store4(ks + i * kp + c, load4(ks + i * kp + c) * decay);
      store4(qs + i * kp + c, load4(qs + i * kp + c) * decay);
    }
  }
}

// The blocks left of the diagonal from relative_rows' rows, on tensor cores
// (3xTF32: the decayed rows are not exact), each of the six blocks by one
// warp.
__device__ void relative_block_grams(
    const float* ks,
    const float* qs,
    int kp,
    const float* columns,
    int kw,
    float* as,
    float* ts,
    int lp) {
  const int warp = threadIdx.x / kWarp;
  // Warp w < 6 the block (ti, tj): (1, 0), (2, 0), (2, 1), (3, 0), ...
  if (warp >= kRelativeColumnRows / kTile) {
    return;
  }
  const int ti = warp < 1 ? 1 : (warp < 3 ? 2 : 3);
  const int tj = warp - relative_column_row(ti) / kTile;
  const float* column = columns + (relative_column_row(ti) + tj * kTile) * kp;
  Product kk, qk;
  for (int c0 = 0; c0 < kw; c0 += 8) {
    kk.add<wmma::row_major, wmma::col_major>(
        ks + ti * kTile * kp + c0, kp, column + c0, kp);
    qk.add<wmma::row_major, wmma::col_major>(
        qs + ti * kTile * kp + c0, kp, column + c0, kp);
  }
  const int tile = ti * kTile * lp + tj * kTile;
  wmma::store_matrix_sync(as + tile, kk.finish(), lp, wmma::mem_row_major);
  wmma::store_matrix_sync(ts + tile, qk.finish(), lp, wmma::mem_row_major);
}

// The diagonal blocks on tensor cores, in a chunk whose decays allow it
// (ChannelGates::tile_products): row tile ti's rows of K and Q are decayed
// from its reference row m already (relative_rows), and its columns are
// k_jc / decay_c(j, m), that row of K times 1 / decay_c(j, m)^2, into
// `columns` (64 rows; relative_block_grams has read its rows); then warp
// w < 4 the block (w, w). Each term is k_ic decay_c(i, m) k_jc /
// decay_c(j, m) = k_ic decay_c(i, j) k_jc; the entries above the diagonal
// are not the grams' and scale_grams drops them.
__device__ void diagonal_block_grams(
    int kw,
    ChannelGates decays,
    const float* ks,
    const float* qs,
    int kp,
    float* columns,
    float* as,
    float* ts,
    int lp) {
  constexpr int kWarps = kChunkedThreads / kWarp;
  const int warp = threadIdx.x / kWarp, c = 4 * (threadIdx.x % kWarp);
  if (c < kw) {
    for (int j = warp; j < kChunk; j += kWarps) {
      store4(
          columns + j * kp + c,
          load4(ks + j * kp + c) *
              decays.inverse_squared(c, j, j / kTile * kTile - 1));
    }
  }
  __syncthreads();
  if (warp >= kChunk / kTile) {
    return;
  }
  const float* rows = ks + warp * kTile * kp;
  const float* column = columns + warp * kTile * kp;
  Product kk, qk;
  for (int c0 = 0; c0 < kw; c0 += 8) {
    kk.add<wmma::row_major, wmma::col_major>(rows + c0, kp, column + c0, kp);
    qk.add<wmma::row_major, wmma::col_major>(
        qs + warp * kTile * kp + c0, kp, column + c0, kp);
  }
  const int tile = warp * kTile * (lp + 1);
  wmma::store_matrix_sync(as + tile, kk.finish(), lp, wmma::mem_row_major);
  wmma::store_matrix_sync(ts + tile, qk.finish(), lp, wmma::mem_row_major);
}

// The scales of the decayed grams in A's and T's buffers (0 above the
// diagonal blocks, which nothing wrote): A = beta_i / (|k_i| |k_j|) K K^T
// strictly below the diagonal, the decayed Q K^T / (|q_i| |k_j|) on and
// below it into qk_out, and T's start, the identity.
__device__ void scale_grams(
    const float* betas,
    const float* key_scales,
    const float* query_scales,
    float* as,
    float* ts,
    int lp,
    float* qk_out) {
  for (int e = threadIdx.x; e < kChunk * kChunk; e += kChunkedThreads) {
    const int i = e / kChunk, j = e % kChunk;
    qk_out[e] =
        j <= i ? query_scales[i] * key_scales[j] * ts[i * lp + j] : 0.0f;
    as[i * lp + j] = j < i
        ? betas[i] * key_scales[i] * key_scales[j] * as[i * lp + j]
        : 0.0f;
    ts[i * lp + j] = i == j ? 1.0f : 0.0f;
  }
}

// One column tile of recompute_w_u's product T_scaled X into `out` (rows of
// `width` floats): T is lower triangular, so row tile ti needs rows
// j < 16 (ti + 1) of X. kExactRows: X's rows are exact tensor-core
// operands (kExactInTf32).
template <bool kExactRows>
__device__ __forceinline__ void lower_product_tile(
    const float* t_scaled,
    int lp,
    const float* operand,
    int stride,
    float* out,
    int width) {
  constexpr int kRowTiles = kChunk / kTile;
  Product products[kRowTiles];
  for (int j0 = 0; j0 < kChunk; j0 += 8) {
    const Operand<OperandB<wmma::row_major>, kExactRows> rows(
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
#pragma unroll
  for (int ti = 0; ti < kRowTiles; ++ti) {
    wmma::store_matrix_sync(
        out + ti * kTile * width,
        products[ti].finish(),
        width,
        wmma::mem_row_major);
  }
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
  // Per-key gates only (launch.cpp's size): relative_rows' column rows
  // [kRelativeColumnRows][kp], the key columns' log2 sums [kChunk][kp],
  // then their last wipes [kChunk][kp] (bytes).
  const bool per_key = a.per_key_gates != 0;
  float* relative_columns = reinterpret_cast<float*>(last_wipe + kChunk);
  float* log2_sums = relative_columns + kRelativeColumnRows * kp;
  ChannelGates channels{
      log2_sums,
      reinterpret_cast<signed char*>(log2_sums + kChunk * kp),
      kp,
      false};

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
  if (per_key) {
    channel_gate_cumsum(a, place, channels);
  }
  keys.store(dk, place.length, a.normalize_qk, key_scales, ks, kp);
  queries.store(dk, place.length, a.normalize_qk, query_scales, qs, kp);
  __syncthreads();
  // K's rows as they are, for chunk_carry: once per key head, by the block
  // of its first value head (per-key gates write their own K below).
  if (!per_key && first_of_key_head(a, place.h)) {
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
  float* qk_out = s.qk + place.index * kChunk * kChunk;
  if (per_key) {
    if (!channels.tile_products) {
      channel_diagonal_grams(kw, channels, ks, qs, kp, as, ts, lp);
    }
    // For chunk_carry and chunk_output, this value head's own K decayed to
    // the chunk's end and Q from its start (kernel_args.h); past the chunk's
    // tokens K and Q are 0.
    // Lane l columns 4 l to 4 l + 3 of every eighth row.
    float* k_out = s.k + place.index * kChunk * kw;
    float* q_out = s.q + place.index * kChunk * kw;
    const int last = place.length - 1;
    const int c = 4 * (threadIdx.x % kWarp);
    for (int i = warp; c < kw && i < kChunk; i += kChunkedThreads / kWarp) {
      store4(
          k_out + i * kw + c,
          load4(ks + i * kp + c) * channels.four(c, last, i));
      store4(
          q_out + i * kw + c,
          load4(qs + i * kp + c) * channels.four(c, i, -1) * query_scales[i]);
    }
    relative_rows(kw, channels, ks, qs, kp, relative_columns);
    __syncthreads();
    relative_block_grams(ks, qs, kp, relative_columns, kw, as, ts, lp);
    __syncthreads();
    if (channels.tile_products) {
      diagonal_block_grams(
          kw, channels, ks, qs, kp, relative_columns, as, ts, lp);
      __syncthreads();
    }
    scale_grams(betas, key_scales, query_scales, as, ts, lp, qk_out);
  } else {
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
    __syncthreads();
    // The decays and the qk_norm scales: kkt_inverse's A (strictly lower),
    // T's start (the identity) and the decayed Q K^T, each element read and
    // written by one thread.
    for (int e = threadIdx.x; e < kChunk * kChunk; e += kChunkedThreads) {
      const int i = e / kChunk, j = e % kChunk;
      const float decay = j <= i ? decays(i, j) * key_scales[j] : 0.0f;
      qk_out[e] = decay * query_scales[i] * ts[i * lp + j];
      as[i * lp + j] =
          j < i ? betas[i] * decay * key_scales[i] * as[i * lp + j] : 0.0f;
      ts[i * lp + j] = i == j ? 1.0f : 0.0f;
    }
  }
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    coefficient[i] = betas[i] * decays(i, -1) * key_scales[i];
  }
  __syncthreads();
  // Q has been read: V takes its buffer, as it is (the barriers of
  // kkt_inverse order these writes before recompute_w_u reads them). With
  // per-key gates K's rows take their decays from the chunk's start,
  // k_jc decay_c(j, -1), for W (their coefficient has no decay then).
  values.store(dv, place.length, false, nullptr, vs, vp);
  if (per_key) {
    // Rows are decayed from their reference row m already (relative_rows):
    // the rest of the way is decay_c(m, -1), nothing for row tile 0. The
    // chunked backward keeps these rows (ChunkScratch::k_from_start).
    float* k_out = s.k_from_start == nullptr
        ? nullptr
        : s.k_from_start + place.index * kChunk * kw;
    const int c = 4 * (threadIdx.x % kWarp);
    for (int i = warp; c < kw && i < kChunk; i += kChunkedThreads / kWarp) {
      float4 row = load4(ks + i * kp + c);
      if (i >= kTile) {
        row = row * channels.four(c, i / kTile * kTile - 1, -1);
        store4(ks + i * kp + c, row);
      }
      if (k_out != nullptr) {
        store4(k_out + i * kw + c, row);
      }
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
            ts + i * kTile * (lp + 1) + k0,
            lp,
            sum + k0 * tile_stride(kTile),
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
    const int w_tiles = kw / kTile;
    const int tiles = w_tiles + vw / kTile;
    for (int tile = warp; tile < tiles; tile += kChunkedThreads / kWarp) {
      const bool is_w = tile < w_tiles;
      const int column = (is_w ? tile : tile - w_tiles) * kTile;
      const float* operand = (is_w ? ks : vs) + column;
      const int stride = is_w ? kp : vp;
      const float* t_scaled = is_w ? as : ts;
      const int width = is_w ? kw : vw;
      float* out = (is_w ? s.w : s.u) + place.index * kChunk * width + column;
      // K decayed (per-key gates) is no longer exact.
      if (is_w && per_key) {
        lower_product_tile<false>(t_scaled, lp, operand, stride, out, width);
      } else {
        lower_product_tile<kExact>(t_scaled, lp, operand, stride, out, width);
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
  // Each state column's decay over the chunk (ChunkScratch::column_decays).
  const int last = place.length - 1;
  for (int c = threadIdx.x; c < kChunkedMaxDim; c += kChunkedThreads) {
    float decay = 0.0f;
    if (c < dk) {
      decay = per_key ? channels(c, last, -1) : decays(last, -1);
    }
    s.column_decays[place.index * kChunkedMaxDim + c] = decay;
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
