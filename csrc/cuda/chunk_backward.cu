// The chunked WY backward on CUDA (docs/stages.md, "Backward: the core
// recurrence"; the math of mlx_gated_delta/reference/chunked_backward.py, and
// chunked_backward_per_key.py for a gate per key channel). The executor first
// reruns the forward's chunk_prepare and chunk_carry (boundary_states: per
// chunk its entry state h, W, V', the decayed Q K^T M, T, the decays and K),
// then:
//
//   chunk_output_backward  one block per (chunk, value head, batch row):
//                          dV' = M^T dO, the output's share (dO = scale dy,
//                          0 where masked), and the entry state's share of
//                          dS, G = (diag(Gamma) dO)^T Q, which does not
//                          depend on dS.
//   chunk_carry_backward   the only sequential pass, one block per
//                          (kCarryRows rows of dS, value head, batch row),
//                          the chunks last to first: keeps dS at each
//                          chunk's end, adds the exit state's share to dV'
//                          (dV' += diag(e) K dS^T) and steps dS back:
//                          dS = dS diag(Gamma_L) + G - dV'^T W. Each row of dS
//                          evolves on its own: what couples the rows comes
//                          after, every chunk at once.
//   chunk_state_products   kStateSlices blocks per (chunk, value head, batch
//                          row), each its own key columns: the
//                          products of chunk_carry_backward with the states,
//                          summed over the value rows: dO S (dq's entry
//                          share), dW = -dV' S, V' dS (dk's exit share) and
//                          <dS, S>.
//   chunk_qk_backward      (chunk_qk_backward.cu) the intra-chunk readout's
//                          dq, dk and decay terms, every chunk at once;
//   chunk_wy_backward      (chunk_wy_backward.cu) the WY form's, every chunk
//                          at once;
//   channel_pairs_backward (channel_pairs_backward.cu, per-key gates only)
//                          every term whose decay differs by key channel,
//                          per channel; then qk_grad_reduce
//                          (recurrent_backward.cu).
//
// With per-key gates the rerun's scratch holds Q and K with their decays
// (kernel_args.h): the stages here take them as Q and K, with the scalar
// decays 1, and chunk_qk_backward and chunk_wy_backward leave the rest to
// channel_pairs_backward.
//
// Matrix products on tensor cores (tensor_core.cuh), float32 accumulation,
// q, k, v and dy as the inputs give them (exact operands in float16 and
// bfloat16), their row scales (qk_norm, decays, beta) applied to the other
// operand or to the result. No atomics: every sum runs in a fixed order.
#include "cuda/chunked_common.cuh"

namespace mlx_gated_delta::cuda {

namespace {

// The scale of dy's row i in dO: the readout's scale, 0 where masked or past
// the chunk's tokens.
__device__ inline float output_scale(const CoreArgs& a, int64_t bt, bool in) {
  return in && (a.mask == nullptr || a.mask[bt]) ? a.scale : 0.0f;
}

// chunk_output_backward: dV' = M^T dO into ChunkBackwardScratch::dv, M the
// decayed Q K^T of chunk_prepare (lower triangular), its rows scaled by dO's
// row scales so that dy is an exact operand; then G = (diag(Gamma / |q|)
// dO)^T Q into ChunkBackwardScratch::ds (chunk_carry_backward reads it there
// and writes dS over it), dy's rows scaled in place. With per-key gates Q is
// chunk_prepare's Q decayed from the chunk's start with its scales
// (ChunkScratch::q), and Gamma and 1 / |q| are 1. Warp w the output tiles
// w, w + 8, ... of each product.
template <typename T>
__device__ __forceinline__ void chunk_output_backward(
    const CoreArgs& a,
    const BackwardArgs& o,
    const ChunkScratch& s,
    const ChunkBackwardScratch& d) {
  extern __shared__ __align__(128) float shared[];
  const int dk = a.key_dim, dv = a.value_dim;
  const int kw = tile_padded(dk), vw = tile_padded(dv);
  const int kp = tile_stride(dk), vp = tile_stride(dv);
  const int lp = tile_stride(kChunk);
  float* ms = shared;  // [kChunk][lp]
  float* dys = ms + kChunk * lp;  // [kChunk][vp]
  float* qs = dys + kChunk * vp;  // [kChunk][kp]: Q as given
  float* query_scales = qs + kChunk * kp;  // [kChunk]
  float* from_start = query_scales + kChunk;  // [kChunk]
  const ChunkPlace place = chunk_place(a, blockIdx.x);
  const int64_t bt0 = int64_t(place.b) * a.tokens + place.t0;
  copy_rows_async(
      s.qk + place.index * kChunk * kChunk, kChunk, kChunk, kChunk, ms, lp);
  __pipeline_commit();
  if (threadIdx.x < kChunk) {
    from_start[threadIdx.x] =
        s.decays[place.index * kDecayRows * kChunk + threadIdx.x];
  }
  load_rows(
      static_cast<const T*>(o.dy) + (bt0 * a.value_heads + place.h) * dv,
      int64_t(a.value_heads) * dv,
      dv,
      place.length,
      false,
      nullptr,
      dys,
      vp);
  const bool per_key = a.per_key_gates != 0;
  load_chunk_queries<T>(a, s, place, query_scales, qs, kp);
  __pipeline_wait_prior(0);
  __syncthreads();
  for (int e = threadIdx.x; e < kChunk * kChunk; e += kChunkedThreads) {
    const int i = e / kChunk, j = e % kChunk;
    ms[i * lp + j] *= output_scale(a, bt0 + i, i < place.length);
  }
  __syncthreads();
  const int warp = threadIdx.x / kWarp;
  {
    const int tiles = kChunk / kTile * (vw / kTile);
    float* out = d.dv + place.index * kChunk * vw;
    for (int tile = warp; tile < tiles; tile += kChunkedThreads / kWarp) {
      const int tj = tile % (kChunk / kTile), tc = tile / (kChunk / kTile);
      // (M^T)_ji = M_ij, nonzero for i >= j.
      Product product;
      for (int i0 = tj * kTile; i0 < kChunk; i0 += 8) {
        product.add<wmma::col_major, wmma::row_major, false, kExactInTf32<T>>(
            ms + i0 * lp + tj * kTile, lp, dys + i0 * vp + tc * kTile, vp);
      }
      wmma::store_matrix_sync(
          out + tj * kTile * vw + tc * kTile, product.finish(), vw,
          wmma::mem_row_major);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kChunk * vw; e += kChunkedThreads) {
    const int i = e / vw, c = e % vw;
    dys[i * vp + c] *= output_scale(a, bt0 + i, i < place.length) *
        from_start[i] * query_scales[i];
  }
  __syncthreads();
  {
    const int row_tiles = vw / kTile;
    const int tiles = row_tiles * (kw / kTile);
    float* out = d.ds + place.index * vw * kw;
    for (int tile = warp; tile < tiles; tile += kChunkedThreads / kWarp) {
      const int tr = tile % row_tiles, tc = tile / row_tiles;
      // (dO^T)_ri = dO_ir: dO's rows the reduction. Q decayed (per-key
      // gates) is no longer exact.
      Product product;
      for (int i0 = 0; i0 < place.length; i0 += 8) {
        if (per_key) {
          product.add<wmma::col_major, wmma::row_major, false, false>(
              dys + i0 * vp + tr * kTile, vp, qs + i0 * kp + tc * kTile, kp);
        } else {
          product.add<wmma::col_major, wmma::row_major, false, kExactInTf32<T>>(
              dys + i0 * vp + tr * kTile, vp, qs + i0 * kp + tc * kTile, kp);
        }
      }
      wmma::store_matrix_sync(
          out + tr * kTile * kw + tc * kTile, product.finish(), kw,
          wmma::mem_row_major);
    }
  }
}

// chunk_carry_backward for kRows rows of dS (value rows row0 ...), in shared
// memory; per chunk, last first, with K (chunk_prepare's rows, as given), W
// and the rows of G (chunk_output_backward) in shared memory:
//   keep dS over G's rows (ChunkBackwardScratch::ds);
//   dV'[:, rows] += diag(e / |k|) K dS^T: warp w token tile w % 4, half
//   w / 4 of Dk (the halves added after);
//   dS = dS diag(Gamma_L) + G - dV'^T W, Gamma_L the chunk's decay of each
//   state column (ChunkScratch::column_decays): warp w the columns
//   [16 w, 16 w + 16) of every row.
// With per-key gates K is the value head's, decayed to the chunk's end (e is
// 1), as chunk_carry reads it.
// Under half of a multiprocessor's shared memory, so that two blocks share
// one: the Qwen3-Next shape's 256 blocks (B = 1) run in one wave on an H200.
template <typename T>
__device__ __forceinline__ void chunk_carry_backward(
    const CoreArgs& a,
    const BackwardArgs& o,
    const ChunkScratch& s,
    const ChunkBackwardScratch& d) {
  constexpr int kRows = kCarryRows;
  static_assert(kRows == kTile, "one row tile of dS a block");
  extern __shared__ __align__(128) float shared[];
  const int dk = a.key_dim, dv = a.value_dim;
  const int kw = tile_padded(dk), vw = tile_padded(dv);
  const int kp = tile_stride(dk), rp = tile_stride(kRows);
  float* ds = shared;  // [kRows][kp]
  float* ks = ds + kRows * kp;  // [kChunk][kp]: K
  float* ws = ks + kChunk * kp;  // [kChunk][kp]: W
  float* gs = ws + kChunk * kp;  // [kRows][kp]: G's rows
  float* intra = gs + kRows * kp;  // [kChunk][rp]: M^T dO, then -dV'
  float* halves = intra + kChunk * rp;  // [2][kChunk][rp]: K dS^T
  float* decays = halves + 2 * kChunk * rp;  // [kDecayRows][kChunk]
  float* column_decays = decays + kDecayRows * kChunk;  // [kChunkedMaxDim]

  const int b = blockIdx.z, h = blockIdx.y;
  const int row0 = blockIdx.x * kRows;
  const int rows = min(kRows, dv - row0);
  const int kh = key_head_of(a, h);
  const int64_t head_state = (int64_t(b) * a.value_heads + h) * dv * dk;
  const int chunks = (a.tokens + kChunk - 1) / kChunk;
  const int64_t key_chunks = (int64_t(b) * a.key_heads + kh) * chunks;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  // Rows past Dv and columns past Dk are 0 (tile padding); the first chunk's
  // barrier orders these writes before any read.
  for (int e = threadIdx.x; e < kRows * kw; e += kChunkedThreads) {
    const int r = e / kw, c = e % kw;
    ds[r * kp + c] = r < rows && c < dk
        ? o.state_cotangent[head_state + int64_t(row0 + r) * dk + c]
        : 0.0f;
  }
  const bool per_key = a.per_key_gates != 0;
  for (int chunk = chunks - 1; chunk >= 0; --chunk) {
    const ChunkPlace place = chunk_place(a, chunk);
    float* g_rows = d.ds + place.index * vw * kw + int64_t(row0) * kw;
    copy_rows_async(
        s.k + (per_key ? place.index : key_chunks + chunk) * kChunk * kw, kw,
        kChunk, kw, ks, kp);
    copy_rows_async(
        s.column_decays + place.index * kChunkedMaxDim, kw, 1, kw,
        column_decays, kw);
    copy_rows_async(s.w + place.index * kChunk * kw, kw, kChunk, kw, ws, kp);
    copy_rows_async(g_rows, kw, kRows, kw, gs, kp);
    copy_rows_async(
        d.dv + place.index * kChunk * vw + row0, vw, kChunk, kRows, intra, rp);
    copy_rows_async(
        s.decays + place.index * kDecayRows * kChunk,
        kChunk,
        kDecayRows,
        kChunk,
        decays,
        kChunk);
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads();
    // dS at the chunk's end, for chunk_state_products, over G's rows (read
    // above).
    for (int r = warp; r < rows; r += kChunkedThreads / kWarp) {
      for (int c = lane; c < dk; c += kWarp) {
        g_rows[r * kw + c] = ds[r * kp + c];
      }
    }

    const float* to_end = decays + kChunk;
    const float* key_scales = decays + 4 * kChunk;
    {
      const int ti = warp % 4, half = warp / 4;
      // K decayed (per-key gates) is no longer exact.
      Product product;
      for (int c0 = half * kw / 2; c0 < (half + 1) * kw / 2; c0 += 8) {
        if (per_key) {
          product.add<wmma::row_major, wmma::col_major, false, false>(
              ks + ti * kTile * kp + c0, kp, ds + c0, kp);
        } else {
          product.add<wmma::row_major, wmma::col_major, kExactInTf32<T>, false>(
              ks + ti * kTile * kp + c0, kp, ds + c0, kp);
        }
      }
      wmma::store_matrix_sync(
          halves + half * kChunk * rp + ti * kTile * rp, product.finish(), rp,
          wmma::mem_row_major);
    }
    __syncthreads();
    float* dv_out = d.dv + place.index * kChunk * vw + row0;
    for (int e = threadIdx.x; e < kChunk * kRows; e += kChunkedThreads) {
      const int i = e / kRows, r = e % kRows;
      const float exit = to_end[i] * key_scales[i] *
          (halves[i * rp + r] + halves[kChunk * rp + i * rp + r]);
      const float delta = intra[i * rp + r] + exit;
      dv_out[i * vw + r] = delta;
      intra[i * rp + r] = -delta;
    }
    // dS diag(Gamma_L): K dS^T has read dS (the barrier above).
    for (int e = threadIdx.x; e < kRows * kw; e += kChunkedThreads) {
      const int r = e / kw, c = e % kw;
      ds[r * kp + c] *= column_decays[c];
    }
    __syncthreads();

    if (warp * kTile < kw) {
      Product update;
      Accumulator entry_share;
      wmma::load_matrix_sync(
          update.sum, ds + warp * kTile, kp, wmma::mem_row_major);
      wmma::load_matrix_sync(
          entry_share, gs + warp * kTile, kp, wmma::mem_row_major);
#pragma unroll
      for (int e = 0; e < update.sum.num_elements; ++e) {
        update.sum.x[e] += entry_share.x[e];
      }
      for (int i0 = 0; i0 < place.length; i0 += 8) {
        update.add<wmma::col_major, wmma::row_major>(
            intra + i0 * rp, rp, ws + i0 * kp + warp * kTile, kp);
      }
      wmma::store_matrix_sync(
          ds + warp * kTile, update.finish(), kp, wmma::mem_row_major);
    }
    __syncthreads();
  }
  for (int e = threadIdx.x; e < kRows * dk; e += kChunkedThreads) {
    const int r = e / dk, c = e % dk;
    if (r < rows) {
      o.dstate[head_state + int64_t(row0 + r) * dk + c] = ds[r * kp + c];
    }
  }
}

// chunk_state_products: with S the chunk's entry state and dS the cotangent
// of its exit state, [Dv, Dk] each in shared memory in turn,
//   dq <- dy S and dw <- -dV' S (S's rows the reduction), then
//   dk <- V' dS and state_dots <- <dS, S>,
// into ChunkBackwardScratch; chunk_qk_backward applies dq's and dk's row
// scales. Each of kStateSlices blocks of a chunk takes its own key columns
// of S and dS (whole 16-column tiles; the last slice may have fewer or
// none), so that a block's shared memory (about 100 KiB at Dk = Dv = 128)
// lets two share a multiprocessor; each writes its share of <dS, S>
// (state_dots[kStateSlices index + slice], which chunk_wy_backward adds in
// order; with per-key gates each column's, state_dots[kw index + c]). Warp w
// the tiles w, w + 8, ... of the slice's [kChunk, columns].
template <typename T>
__device__ __forceinline__ void chunk_state_products(
    const CoreArgs& a,
    const BackwardArgs& o,
    const ChunkScratch& s,
    const ChunkBackwardScratch& d) {
  extern __shared__ __align__(128) float shared[];
  const int dk = a.key_dim, dv = a.value_dim;
  const int kw = tile_padded(dk), vw = tile_padded(dv);
  const int vp = tile_stride(dv);
  const int slice_tiles = (kw / kTile + kStateSlices - 1) / kStateSlices;
  const int sp = slice_tiles * kTile + kTileSkew;
  const int slice = blockIdx.x % kStateSlices;
  const int c0 = slice * slice_tiles * kTile;
  const int cw = max(0, min(kw, c0 + slice_tiles * kTile) - c0);
  const int cd = max(0, min(dk, c0 + cw) - c0);  // columns below Dk
  float* states = shared;  // [vw][sp]: S, then dS
  float* left = states + vw * sp;  // [kChunk][vp]: dy, then V'
  float* dvs = left + kChunk * vp;  // [kChunk][vp]: dV'
  float* sums = dvs + kChunk * vp;  // [kChunkedThreads / kWarp]
  const ChunkPlace place = chunk_place(a, blockIdx.x / kStateSlices);
  const int64_t bt0 = int64_t(place.b) * a.tokens + place.t0;
  const int64_t state_at = place.index * dv * dk + c0;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int e = threadIdx.x; e < vw * cw; e += kChunkedThreads) {
    const int r = e / cw, c = e % cw;
    if (r >= dv || c >= cd) {
      states[r * sp + c] = 0.0f;
    }
  }
  copy_rows_async(s.h + state_at, dk, dv, cd, states, sp);
  copy_rows_async(d.dv + place.index * kChunk * vw, vw, kChunk, vw, dvs, vp);
  __pipeline_commit();
  load_rows(
      static_cast<const T*>(o.dy) + (bt0 * a.value_heads + place.h) * dv,
      int64_t(a.value_heads) * dv,
      dv,
      place.length,
      false,
      nullptr,
      left,
      vp);
  __pipeline_wait_prior(0);
  __syncthreads();

  constexpr int kMaxTiles = kChunk / kTile * (kChunkedMaxDim / kTile) * kWarp /
      kChunkedThreads / kStateSlices;
  const int tiles = kChunk / kTile * (cw / kTile);
  const int64_t rows_at = place.index * kChunk * kw + c0;
#pragma unroll
  for (int n = 0; n < kMaxTiles; ++n) {
    const int tile = warp + n * kChunkedThreads / kWarp;
    if (tile < tiles) {
      const int ti = tile % (kChunk / kTile), tc = tile / (kChunk / kTile);
      Product readout, w_grad;
      for (int r0 = 0; r0 < vw; r0 += 8) {
        const Operand<OperandB<wmma::row_major>, false> state_rows(
            states + r0 * sp + tc * kTile, sp);
        readout.add(
            Operand<OperandA<wmma::row_major>, kExactInTf32<T>>(
                left + ti * kTile * vp + r0, vp),
            state_rows);
        w_grad.add(
            Operand<OperandA<wmma::row_major>, false>(
                dvs + ti * kTile * vp + r0, vp),
            state_rows);
      }
      Accumulator& dw = w_grad.finish();
#pragma unroll
      for (int e = 0; e < dw.num_elements; ++e) {
        dw.x[e] = -dw.x[e];
      }
      const int64_t at = rows_at + ti * kTile * kw + tc * kTile;
      wmma::store_matrix_sync(
          d.dq + at, readout.finish(), kw, wmma::mem_row_major);
      wmma::store_matrix_sync(d.dw + at, dw, kw, wmma::mem_row_major);
    }
  }
  __syncthreads();
  // With per-key gates <dS, S> per key column first, a thread per column
  // summing its rows in order, before dS replaces S.
  const bool per_key = a.per_key_gates != 0;
  if (per_key) {
    for (int c = threadIdx.x; c < cd; c += kChunkedThreads) {
      float column_dot = 0.0f;
      for (int r = 0; r < dv; ++r) {
        column_dot +=
            d.ds[place.index * vw * kw + r * kw + c0 + c] * states[r * sp + c];
      }
      d.state_dots[place.index * kw + c0 + c] = column_dot;
    }
    __syncthreads();
  }
  // dS over S, each element read and replaced by one thread, <dS, S> summed
  // on the way (per thread, then per warp, then the warps in order).
  copy_rows_async(s.u + place.index * kChunk * vw, vw, kChunk, vw, left, vp);
  __pipeline_commit();
  float dot = 0.0f;
  for (int e = threadIdx.x; e < dv * cd; e += kChunkedThreads) {
    const int r = e / cd, c = e % cd;
    const float x = d.ds[place.index * vw * kw + r * kw + c0 + c];
    dot += x * states[r * sp + c];
    states[r * sp + c] = x;
  }
  dot = warp_sum(dot);
  if (lane == 0) {
    sums[warp] = dot;
  }
  __pipeline_wait_prior(0);
  __syncthreads();
  if (threadIdx.x == 0 && !per_key) {
    float total = 0.0f;
    for (int w = 0; w < kChunkedThreads / kWarp; ++w) {
      total += sums[w];
    }
    d.state_dots[kStateSlices * place.index + slice] = total;
  }
#pragma unroll
  for (int n = 0; n < kMaxTiles; ++n) {
    const int tile = warp + n * kChunkedThreads / kWarp;
    if (tile < tiles) {
      const int ti = tile % (kChunk / kTile), tc = tile / (kChunk / kTile);
      Product exit;
      for (int r0 = 0; r0 < vw; r0 += 8) {
        exit.add<wmma::row_major, wmma::row_major>(
            left + ti * kTile * vp + r0, vp, states + r0 * sp + tc * kTile, sp);
      }
      wmma::store_matrix_sync(
          d.dk + rows_at + ti * kTile * kw + tc * kTile, exit.finish(), kw,
          wmma::mem_row_major);
    }
  }
}

}  // namespace

}  // namespace mlx_gated_delta::cuda

// The entry points the executor looks up by name:
// gd_chunk_output_backward_<dtype>, gd_chunk_carry_backward_<dtype> and
// gd_chunk_state_products_<dtype> (these two: two blocks a multiprocessor,
// at most 128 registers a thread).
#define GD_CHUNK_BACKWARD_ENTRY(name, type, suffix, blocks)      \
  extern "C" __global__ void __launch_bounds__(                  \
      mlx_gated_delta::cuda::kChunkedThreads, blocks)            \
      gd_##name##_##suffix(                                      \
          const mlx_gated_delta::cuda::CoreArgs a,               \
          const mlx_gated_delta::cuda::BackwardArgs o,           \
          const mlx_gated_delta::cuda::ChunkScratch s,           \
          const mlx_gated_delta::cuda::ChunkBackwardScratch d) { \
    mlx_gated_delta::cuda::name<type>(a, o, s, d);               \
  }
#define GD_CHUNK_BACKWARD_ENTRIES(type, suffix)                   \
  GD_CHUNK_BACKWARD_ENTRY(chunk_output_backward, type, suffix, 1) \
  GD_CHUNK_BACKWARD_ENTRY(chunk_carry_backward, type, suffix, 2)  \
  GD_CHUNK_BACKWARD_ENTRY(chunk_state_products, type, suffix, 2)
GD_CHUNK_BACKWARD_ENTRIES(float, f32)
GD_CHUNK_BACKWARD_ENTRIES(__half, f16)
GD_CHUNK_BACKWARD_ENTRIES(__nv_bfloat16, bf16)
