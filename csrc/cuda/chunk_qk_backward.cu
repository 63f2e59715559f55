// chunk_qk_backward: the chunked backward's share of the intra-chunk
// readout y_i += sum_{j <= i} decay(i, j) (q_i . k_j) v'_j, every chunk at
// once, one block per (chunk, value head, batch row), after
// chunk_state_products (chunk_backward.cu) and before chunk_wy_backward.
// With dM = dO V'^T (lower), q, k the normalised rows, s_i dO's row scale,
// Gamma_i = decay(i, -1), e_j = decay(L-1, j):
//   dq = s Gamma (dy S) + (dM o decay) K, complete here: written to the
//   partial sums (BackwardArgs::partials, one block);
//   dk = e (V' dS) + (dM o decay)^T Q, to which chunk_wy_backward adds the
//   WY form's terms (ChunkBackwardScratch::dk);
//   the decays' gradients without the decays, P_ij = dM_ij q_i . k_j
//   (ChunkBackwardScratch::pairs), P_{i,-1} = s_i (dy S)_i . q_i and
//   P_{L-1,j} = (V' dS)_j . k_j (ChunkBackwardScratch::ends).
// With per-key gates it writes dM alone (ChunkBackwardScratch::pairs), and
// channel_pairs_backward takes the rest per key channel.
// Two row buffers and two [L, L] ones (about 102 KiB at Dk = Dv = 128), so
// that two blocks share a multiprocessor.
#include "cuda/chunk_backward_products.cuh"

namespace mlx_gated_delta::cuda {

namespace {

template <typename T>
__device__ __forceinline__ void chunk_qk_backward(
    const CoreArgs& a,
    const BackwardArgs& o,
    const ChunkScratch& s,
    const ChunkBackwardScratch& d) {
  extern __shared__ __align__(128) float shared[];
  constexpr bool kExact = kExactInTf32<T>;
  constexpr int kWarps = kBackwardChunkWarps;
  const int dk = a.key_dim, dv = a.value_dim;
  const int kw = tile_padded(dk), vw = tile_padded(dv);
  const int xp = max(tile_stride(dk), tile_stride(dv));
  const int lp = tile_stride(kChunk);
  float* xa = shared;  // [L][xp]: dy, then Q
  float* xb = xa + kChunk * xp;  // [L][xp]: V', then K
  float* ld = xb + kChunk * xp;  // [L][lp]: dy V'^T, then (dM o decay) diag(1/|k|)
  float* lq = ld + kChunk * lp;  // [L][lp]: Q K^T, then diag(1/|q|) (dM o decay)
  float* decays = lq + kChunk * lp;  // [kDecayRows][L]
  float* query_scales = decays + kDecayRows * kChunk;
  float* row_scales = query_scales + kChunk;  // s_i
  const float* from_start = decays;
  const float* to_end = decays + kChunk;
  const float* log_sum = decays + 2 * kChunk;
  const float* last_wipe = decays + 3 * kChunk;
  const float* key_scales = decays + 4 * kChunk;

  const ChunkPlace place = chunk_place(a, blockIdx.x);
  const int length = place.length;
  const int kh = key_head_of(a, place.h);
  const int64_t bt0 = int64_t(place.b) * a.tokens + place.t0;
  const int chunks = (a.tokens + kChunk - 1) / kChunk;
  const int64_t key_chunk =
      (int64_t(place.b) * a.key_heads + kh) * chunks + place.chunk;
  float* dq_rows = d.dq + place.index * kChunk * kw;
  float* dk_rows = d.dk + place.index * kChunk * kw;
  float* pairs = d.pairs + place.index * kChunk * kChunk;
  float* entry = d.ends + place.index * 2 * kChunk;
  float* exit = entry + kChunk;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;

  copy_rows_async(s.u + place.index * kChunk * vw, vw, kChunk, vw, xb, xp);
  copy_rows_async(
      s.decays + place.index * kDecayRows * kChunk, kChunk, kDecayRows, kChunk,
      decays, kChunk);
  __pipeline_commit();
  load_rows(
      static_cast<const T*>(o.dy) + (bt0 * a.value_heads + place.h) * dv,
      int64_t(a.value_heads) * dv, dv, length, false, nullptr, xa, xp);
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    const bool active =
        i < length && (a.mask == nullptr || a.mask[bt0 + i]);
    row_scales[i] = active ? a.scale : 0.0f;
  }
  // Q's loads are in flight during dy V'^T; per-key gates do not read Q here.
  const bool per_key = a.per_key_gates != 0;
  ChunkRows queries;
  if (!per_key) {
    queries.fetch(
        static_cast<const T*>(a.q) + (bt0 * a.key_heads + kh) * dk,
        int64_t(a.key_heads) * dk, dk, length);
  }
  __pipeline_wait_prior(0);
  __syncthreads();
  lower_gram<kExact, false>(xa, xp, xb, xp, vw, ld, lp);  // dy V'^T
  __syncthreads();
  if (per_key) {
    // Per-key gates: dM alone, for channel_pairs_backward.
    for (int e = threadIdx.x; e < kChunk * kChunk; e += kChunkedThreads) {
      const int i = e / kChunk, j = e % kChunk;
      pairs[e] = j <= i && i < length ? row_scales[i] * ld[i * lp + j] : 0.0f;
    }
    return;
  }
  copy_rows_async(s.k + key_chunk * kChunk * kw, kw, kChunk, kw, xb, xp);
  __pipeline_commit();
  queries.store(dk, length, a.normalize_qk, query_scales, xa, xp);
  __pipeline_wait_prior(0);
  __syncthreads();
  lower_gram<kExact, kExact>(xa, xp, xb, xp, kw, lq, lp);  // Q K^T
  // chunk_state_products' rows: dq = s Gamma (dy S), entry terms s (dy S).q;
  // dk = e (V' dS), exit terms (V' dS).k. A warp per row.
  for (int i = warp; i < kChunk; i += kWarps) {
    float q_dot = 0.0f, k_dot = 0.0f;
    for (int c = lane; c < kw; c += kWarp) {
      q_dot += dq_rows[i * kw + c] * xa[i * xp + c];
      k_dot += dk_rows[i * kw + c] * xb[i * xp + c];
    }
    q_dot = warp_sum(q_dot);
    k_dot = warp_sum(k_dot);
    const float q_scale = row_scales[i] * from_start[i];
    for (int c = lane; c < kw; c += kWarp) {
      dq_rows[i * kw + c] *= q_scale;
      dk_rows[i * kw + c] *= to_end[i];
    }
    if (lane == 0) {
      entry[i] = row_scales[i] * query_scales[i] * q_dot;
      exit[i] = key_scales[i] * k_dot;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kChunk * kChunk; e += kChunkedThreads) {
    const int i = e / kChunk, j = e % kChunk;
    const bool lower = j <= i && i < length;
    const float decay = lower ? chunk_decay(log_sum, last_wipe, i, j) : 0.0f;
    const float dm = lower ? row_scales[i] * ld[i * lp + j] : 0.0f;
    const float qk = query_scales[i] * key_scales[j] * lq[i * lp + j];
    pairs[e] = j < i ? dm * qk : 0.0f;
    ld[i * lp + j] = dm * decay * key_scales[j];
    lq[i * lp + j] = query_scales[i] * dm * decay;
  }
  __syncthreads();
  accumulate_rows<false, kExact>(dq_rows, kw, ld, lp, xb, xp);
  accumulate_rows<true, kExact>(dk_rows, kw, lq, lp, xa, xp);
  __syncthreads();
  // dq of the chunk's tokens (0 where masked).
  const int width = backward_partial_width(dk, false);
  for (int i = warp; i < length; i += kWarps) {
    const int64_t bt = bt0 + i;
    const bool active = a.mask == nullptr || a.mask[bt];
    float* out = o.partials + (bt * a.value_heads + place.h) * width;
    for (int c = lane; c < dk; c += kWarp) {
      out[c] = active ? dq_rows[i * kw + c] : 0.0f;
    }
  }
}

}  // namespace

}  // namespace mlx_gated_delta::cuda

// The entry points the executor looks up by name: gd_chunk_qk_backward_<dtype>
// (two blocks a multiprocessor: at most 128 registers a thread).
#define GD_CHUNK_QK_BACKWARD_ENTRY(type, suffix)                 \
  extern "C" __global__ void __launch_bounds__(                  \
      mlx_gated_delta::cuda::kChunkedThreads, 2)                 \
      gd_chunk_qk_backward_##suffix(                             \
          const mlx_gated_delta::cuda::CoreArgs a,               \
          const mlx_gated_delta::cuda::BackwardArgs o,           \
          const mlx_gated_delta::cuda::ChunkScratch s,           \
          const mlx_gated_delta::cuda::ChunkBackwardScratch d) { \
    mlx_gated_delta::cuda::chunk_qk_backward<type>(a, o, s, d);  \
  }
GD_CHUNK_QK_BACKWARD_ENTRY(float, f32)
GD_CHUNK_QK_BACKWARD_ENTRY(__half, f16)
GD_CHUNK_QK_BACKWARD_ENTRY(__nv_bfloat16, bf16)
