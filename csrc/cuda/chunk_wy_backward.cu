// chunk_wy_backward: the chunked backward's WY-form stages, every chunk at
// once, one block per (chunk, value head, batch row), after
// chunk_qk_backward (chunk_qk_backward.cu): recompute_w_u_backward,
// kkt_inverse_backward and gate_cumsum_backward, the math of
// mlx_gated_delta/reference/chunked_backward.py with the CPU's gradient of
// the decays (csrc/cpu/chunked_backward_stages.h, decay_gradient). It writes
// dv and each token's dk of the normalised rows, dgamma and dbeta in the
// layout of BackwardArgs::partials (one block: partial_blocks = 1; dq is
// chunk_qk_backward's), which qk_grad_reduce takes through the head mapping
// and qk_norm.
//
// In the chunk, with k the normalised rows, Gamma_i = decay(i, -1), beta as
// the forward took it (0 where masked):
//   dT = tril(dV' diag(beta) V^T + dW diag(beta Gamma) K^T)
//   dVb = T^T dV'; dv = diag(beta) dVb; dKb = T^T dW; dk += diag(beta Gamma) dKb
//   dA = -T^T dT T^T (strictly lower); D = diag(beta) (dA o decay);
//   dk += (D + D^T) K
//   dbeta = (dVb . v) + Gamma (dKb . k) + sum_j dA_ij decay(i, j) k_i . k_j
// and every decay's gradient without the decay, P_ij (j = -1: Gamma_i), for
// gate_cumsum_backward: chunk_qk_backward's P_ij + dA_ij beta_i k_i . k_j,
// its entry terms + beta_i (dKb_i . k_i) (+ <dS, S> at the last row), and
// its exit terms at the last row.
//
// Two row buffers and two [L, L] ones (about 102 KiB at Dk = Dv = 128), so
// that two blocks share a multiprocessor: W's side comes first (dT's dW K^T
// part), then U's (dV' V^T added onto it), then kkt_inverse_backward; K is
// loaded again over V while the kkt products run.
#include "cuda/chunk_backward_products.cuh"

namespace mlx_gated_delta::cuda {

namespace {

constexpr int kWarps = kBackwardChunkWarps;
constexpr int kTiles = kChunkTiles;

// gate_cumsum_backward: dgamma_t = sum_{i >= t > j} P_ij decay(i, t)
// decay(t-1, j) (j = -1: entry_i = P_{i,-1}) as two scans of the chunk
// instead of a double sum per t:
//   C_i0 = entry_i, C_{i,t+1} = P_it + gamma_t C_it, so that
//   C_it = sum_{j < t} P_ij decay(t-1, j) (a thread per row i; C_it replaces
//   P_it in `pairs`), then
//   dgamma_t = sum_{i >= t} decay(i, t) C_it (a thread per t).
// The decays as running products of gamma (no exp: exact where gamma is
// tiny, and 0 past a wipe). Every thread of the block calls it (a barrier
// between the scans); thread t < length gets dgamma_t.
__device__ inline float gate_cumsum_backward(
    float* pairs, int lp, const float* entry, const float* gammas,
    int length) {
  if (threadIdx.x < length) {
    const int i = threadIdx.x;
    float carried = entry[i];
    for (int t = 0; t < length; ++t) {
      const float pair = pairs[i * lp + t];
      pairs[i * lp + t] = carried;
      carried = pair + gammas[t] * carried;
    }
  }
  __syncthreads();
  float d_gamma = 0.0f;
  if (threadIdx.x < length) {
    const int t = threadIdx.x;
    float to_i = 1.0f;
    for (int i = 0; i < length; ++i) {
      if (i > t) {
        to_i *= gammas[i];
      }
      if (i >= t) {
        d_gamma += to_i * pairs[i * lp + t];
      }
    }
  }
  return d_gamma;
}

template <typename T>
__device__ __forceinline__ void chunk_wy_backward(
    const CoreArgs& a,
    const BackwardArgs& o,
    const ChunkScratch& s,
    const ChunkBackwardScratch& d) {
  extern __shared__ __align__(128) float shared[];
  constexpr bool kExact = kExactInTf32<T>;
  const int dk = a.key_dim, dv = a.value_dim;
  const int kw = tile_padded(dk), vw = tile_padded(dv);
  const int xp = max(tile_stride(dk), tile_stride(dv));
  const int lp = tile_stride(kChunk);
  float* xa = shared;  // [L][xp]: K, then V, then K
  float* xb = xa + kChunk * xp;  // [L][xp]: dW, then dKb, then dV', then dVb
  float* ld = xb + kChunk * xp;  // [L][lp]: T, then K K^T, then D, then (D + D^T) diag(1/|k|)
  float* lq = ld + kChunk * lp;  // [L][lp]: dW K^T, then dT, then dT T^T, then dA, then P_ij
  float* decays = lq + kChunk * lp;  // [kDecayRows][L]
  float* betas = decays + kDecayRows * kChunk;
  float* gammas = betas + kChunk;
  float* entry = gammas + kChunk;  // P_{i,-1}
  float* dbeta = entry + kChunk;
  const float* from_start = decays;
  const float* log_sum = decays + 2 * kChunk;
  const float* last_wipe = decays + 3 * kChunk;
  const float* key_scales = decays + 4 * kChunk;

  const ChunkPlace place = chunk_place(a, blockIdx.x);
  const int length = place.length;
  const int kh = key_head_of(a, place.h);
  const int64_t bt0 = int64_t(place.b) * a.tokens + place.t0;
  const int64_t value_stride = int64_t(a.value_heads) * dv;
  const int chunks = (a.tokens + kChunk - 1) / kChunk;
  // With per-key gates W's K is decayed from the chunk's start per channel
  // (ChunkScratch::k_from_start; Gamma is 1 in `decays`), and
  // channel_pairs_backward takes every term with a channel's decay in it.
  const bool per_key = a.per_key_gates != 0;
  const float* k_rows = per_key
      ? s.k_from_start + place.index * kChunk * kw
      : s.k +
          ((int64_t(place.b) * a.key_heads + kh) * chunks + place.chunk) *
              kChunk * kw;
  float* dk_rows = d.dk + place.index * kChunk * kw;
  const float* qk_pairs = d.pairs + place.index * kChunk * kChunk;
  const float* exit = d.ends + place.index * 2 * kChunk + kChunk;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;

  copy_rows_async(k_rows, kw, kChunk, kw, xa, xp);
  copy_rows_async(d.dw + place.index * kChunk * kw, kw, kChunk, kw, xb, xp);
  copy_rows_async(
      s.t + place.index * kChunk * kChunk, kChunk, kChunk, kChunk, ld, lp);
  copy_rows_async(
      s.decays + place.index * kDecayRows * kChunk, kChunk, kDecayRows, kChunk,
      decays, kChunk);
  __pipeline_commit();
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    const int64_t bt = bt0 + i;
    const bool active = i < length && (a.mask == nullptr || a.mask[bt]);
    const int64_t gate = bt * a.value_heads + place.h;
    betas[i] = active ? a.beta[gate] : 0.0f;
    gammas[i] = active && !per_key ? expf(a.g[gate]) : 1.0f;
    entry[i] = per_key ? 0.0f : d.ends[place.index * 2 * kChunk + i];
    dbeta[i] = 0.0f;
  }
  __pipeline_wait_prior(0);
  __syncthreads();

  // recompute_w_u_backward, W's side: dW K^T, dKb = T^T dW (over dW). K
  // decayed (per-key gates) is no longer exact.
  if (per_key) {
    lower_gram<false, false>(xb, xp, xa, xp, kw, lq, lp);
  } else {
    lower_gram<false, kExact>(xb, xp, xa, xp, kw, lq, lp);
  }
  inverse_transposed_times(ld, lp, xb, xp, kw, xb, xp);
  __syncthreads();
  for (int e = threadIdx.x; e < kChunk * kChunk; e += kChunkedThreads) {
    const int i = e / kChunk, j = e % kChunk;
    lq[i * lp + j] =
        j <= i ? from_start[j] * key_scales[j] * lq[i * lp + j] : 0.0f;
  }
  for (int i = warp; i < kChunk; i += kWarps) {
    float dot = 0.0f;
    for (int c = lane; c < kw; c += kWarp) {
      dot += xb[i * xp + c] * xa[i * xp + c];
    }
    const float key_term = key_scales[i] * warp_sum(dot);
    const float w_scale = betas[i] * from_start[i];
    for (int c = lane; c < kw; c += kWarp) {
      if (per_key) {
        d.dw[place.index * kChunk * kw + i * kw + c] = xb[i * xp + c];
      } else {
        dk_rows[i * kw + c] += w_scale * xb[i * xp + c];
      }
    }
    if (lane == 0) {
      dbeta[i] += from_start[i] * key_term;
      entry[i] += betas[i] * key_term;
    }
  }
  __syncthreads();

  // U's side: dV' V^T added, dVb = T^T dV' (over dV'); dT = tril of the sum
  // with beta on its columns.
  copy_rows_async(d.dv + place.index * kChunk * vw, vw, kChunk, vw, xb, xp);
  __pipeline_commit();
  load_rows(
      static_cast<const T*>(a.v) + (bt0 * a.value_heads + place.h) * dv,
      value_stride, dv, length, false, nullptr, xa, xp);
  __pipeline_wait_prior(0);
  __syncthreads();
  lower_gram<false, kExact, true>(xb, xp, xa, xp, vw, lq, lp);
  inverse_transposed_times(ld, lp, xb, xp, vw, xb, xp);
  __syncthreads();
  for (int e = threadIdx.x; e < kChunk * kChunk; e += kChunkedThreads) {
    const int i = e / kChunk, j = e % kChunk;
    lq[i * lp + j] = j <= i ? betas[j] * lq[i * lp + j] : 0.0f;
  }
  T* dv_out = static_cast<T*>(o.dv) + (bt0 * a.value_heads + place.h) * dv;
  for (int i = warp; i < length; i += kWarps) {
    float dot = 0.0f;
    for (int c = lane; c < dv; c += kWarp) {
      dot += xb[i * xp + c] * xa[i * xp + c];
      dv_out[i * value_stride + c] = from_float<T>(betas[i] * xb[i * xp + c]);
    }
    dot = warp_sum(dot);
    if (lane == 0) {
      dbeta[i] += dot;
    }
  }
  __syncthreads();
  // K again, over V, for K K^T and (D + D^T) K, which per-key gates leave
  // to channel_pairs_backward; it lands during the products below.
  if (!per_key) {
    copy_rows_async(k_rows, kw, kChunk, kw, xa, xp);
    __pipeline_commit();
  }

  // kkt_inverse_backward: X = dT T^T (X_ij = sum_{m <= min(i, j)} dT_im
  // T_jm, over dT), then dA = -T^T X on the strictly lower triangle (over
  // X).
  {
    Product x[2];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int tile = warp + n * kWarps;
      const int ti = tile / kTiles, tj = tile % kTiles;
      for (int m0 = 0; m0 < (min(ti, tj) + 1) * kTile; m0 += 8) {
        x[n].add<wmma::row_major, wmma::col_major>(
            lq + ti * kTile * lp + m0, lp, ld + tj * kTile * lp + m0, lp);
      }
    }
    __syncthreads();
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int tile = warp + n * kWarps;
      const int ti = tile / kTiles, tj = tile % kTiles;
      wmma::store_matrix_sync(
          lq + ti * kTile * lp + tj * kTile, x[n].finish(), lp,
          wmma::mem_row_major);
    }
    __syncthreads();
    const int ti = warp / 2;
    Product products[2];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int tj = 2 * (warp % 2) + n;
      if (tj <= ti) {
        for (int m0 = ti * kTile; m0 < kChunk; m0 += 8) {
          products[n].add<wmma::col_major, wmma::row_major>(
              ld + m0 * lp + ti * kTile, lp, lq + m0 * lp + tj * kTile, lp);
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int tj = 2 * (warp % 2) + n;
      Accumulator& da = products[n].finish();
#pragma unroll
      for (int e = 0; e < da.num_elements; ++e) {
        da.x[e] = -da.x[e];
      }
      wmma::store_matrix_sync(
          lq + ti * kTile * lp + tj * kTile, da, lp, wmma::mem_row_major);
    }
  }
  __pipeline_wait_prior(0);
  __syncthreads();
  const int width = backward_partial_width(dk, per_key);
  if (per_key) {
    // dA and the shares of dbeta so far, for channel_pairs_backward.
    float* da = d.da + place.index * kChunk * kChunk;
    for (int e = threadIdx.x; e < kChunk * kChunk; e += kChunkedThreads) {
      const int i = e / kChunk, j = e % kChunk;
      da[e] = j < i && i < length ? lq[i * lp + j] : 0.0f;
    }
    if (threadIdx.x < length) {
      const int64_t bt = bt0 + threadIdx.x;
      o.partials[(bt * a.value_heads + place.h) * width + 3 * dk] =
          dbeta[threadIdx.x];
    }
    return;
  }
  lower_gram<kExact, kExact>(xa, xp, xa, xp, kw, ld, lp);  // K K^T, over T
  __syncthreads();
  // A_ij = beta_i decay(i, j) k_i . k_j: its pair terms (added to
  // chunk_qk_backward's, with the exit state's at the last row: P over dA),
  // dbeta, and D = diag(beta) (dA o decay) over K K^T. A warp per row.
  for (int i = warp; i < kChunk; i += kWarps) {
    float dot = 0.0f;
    for (int j = lane; j < kChunk; j += kWarp) {
      float pair = qk_pairs[i * kChunk + j], dak = 0.0f;
      if (j < i && i < length) {
        const float da = lq[i * lp + j];
        const float decay = chunk_decay(log_sum, last_wipe, i, j);
        const float kk = key_scales[i] * key_scales[j] * ld[i * lp + j];
        pair += da * betas[i] * kk;
        dot += da * decay * kk;
        dak = betas[i] * decay * da;
      }
      if (i == length - 1 && j < length - 1) {
        pair += exit[j];
      }
      lq[i * lp + j] = pair;
      ld[i * lp + j] = dak;
    }
    dot = warp_sum(dot);
    if (lane == 0) {
      dbeta[i] += dot;
    }
  }
  // Gamma_{L-1}'s <dS, S>, its slices' shares added in order.
  if (threadIdx.x == 0) {
    float state_dot = 0.0f;
    for (int slice = 0; slice < kStateSlices; ++slice) {
      state_dot += d.state_dots[kStateSlices * place.index + slice];
    }
    entry[length - 1] += state_dot;
  }
  __syncthreads();
  // (D + D^T) diag(1/|k|) over D, a thread per pair (i, j), j <= i.
  for (int e = threadIdx.x; e < kChunk * kChunk; e += kChunkedThreads) {
    const int i = e / kChunk, j = e % kChunk;
    if (j <= i) {
      const float sum = ld[i * lp + j] + ld[j * lp + i];
      ld[i * lp + j] = sum * key_scales[j];
      ld[j * lp + i] = sum * key_scales[i];
    }
  }
  __syncthreads();
  accumulate_rows<false, kExact, true>(dk_rows, kw, ld, lp, xa, xp);

  const float d_gamma = gate_cumsum_backward(lq, lp, entry, gammas, length);
  if (threadIdx.x < length) {
    const int t = threadIdx.x;
    const int64_t bt = bt0 + t;
    const bool active = a.mask == nullptr || a.mask[bt];
    float* out = o.partials + (bt * a.value_heads + place.h) * width;
    out[2 * dk] = active ? d_gamma : 0.0f;
    out[2 * dk + 1] = active ? dbeta[t] : 0.0f;
  }
  // dk of the chunk's tokens (0 where masked); gate_cumsum_backward's
  // barrier ordered dk's products before these reads.
  for (int i = warp; i < length; i += kWarps) {
    const int64_t bt = bt0 + i;
    const bool active = a.mask == nullptr || a.mask[bt];
    float* out = o.partials + (bt * a.value_heads + place.h) * width;
    for (int c = lane; c < dk; c += kWarp) {
      out[dk + c] = active ? dk_rows[i * kw + c] : 0.0f;
    }
  }
}

}  // namespace

}  // namespace mlx_gated_delta::cuda

// The entry points the executor looks up by name: gd_chunk_wy_backward_<dtype>
// (two blocks a multiprocessor: at most 128 registers a thread).
#define GD_CHUNK_WY_BACKWARD_ENTRY(type, suffix)                 \
  extern "C" __global__ void __launch_bounds__(                  \
      mlx_gated_delta::cuda::kChunkedThreads, 2)                 \
      gd_chunk_wy_backward_##suffix(                             \
          const mlx_gated_delta::cuda::CoreArgs a,               \
          const mlx_gated_delta::cuda::BackwardArgs o,           \
          const mlx_gated_delta::cuda::ChunkScratch s,           \
          const mlx_gated_delta::cuda::ChunkBackwardScratch d) { \
    mlx_gated_delta::cuda::chunk_wy_backward<type>(a, o, s, d);  \
  }
GD_CHUNK_WY_BACKWARD_ENTRY(float, f32)
GD_CHUNK_WY_BACKWARD_ENTRY(__half, f16)
GD_CHUNK_WY_BACKWARD_ENTRY(__nv_bfloat16, bf16)
