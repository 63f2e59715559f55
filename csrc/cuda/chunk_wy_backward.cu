// chunk_wy_backward: the chunked backward's per-chunk stages after the
// sequential pass (chunk_backward.cu), every chunk at once, one block per
// (chunk, value head, batch row): chunk_output_backward's dq, dk and decay
// terms, recompute_w_u_backward, kkt_inverse_backward and
// gate_cumsum_backward, the math of mlx_gated_delta/reference/
// chunked_backward.py with the CPU's gradient of the decays
// (csrc/cpu/chunked_backward_stages.h, decay_gradient). It writes dv and each
// token's sums (dq and dk of the normalised rows, dgamma, dbeta) in the
// layout of BackwardArgs::partials (one block: partial_blocks = 1), which
// qk_grad_reduce takes through the head mapping and qk_norm.
//
// In the chunk, with q, k the normalised rows (q_i = q'_i / |q'_i| with
// qk_norm, q' as the inputs give it), s_i dO's row scale, Gamma_i =
// decay(i, -1), e_j = decay(L-1, j), beta as the forward took it (0 where
// masked):
//   dM = dO V'^T; dq += (dM o decay) K; dk += (dM o decay)^T Q
//   dT = tril(dV' diag(beta) V^T + dW diag(beta Gamma) K^T)
//   dVb = T^T dV'; dv = diag(beta) dVb; dKb = T^T dW; dk += diag(beta Gamma) dKb
//   dA = -T^T dT T^T (strictly lower); D = diag(beta) (dA o decay);
//   dk += (D + D^T) K
//   dbeta = (dVb . v) + Gamma (dKb . k) + sum_j dA_ij decay(i, j) k_i . k_j
// and every decay's gradient without the decay, P_ij (j = -1: Gamma_i), for
// gate_cumsum_backward: dM_ij q_i . k_j + dA_ij beta_i k_i . k_j, (dO S)_i .
// q_i + beta_i (dKb_i . k_i) (+ <dS, S> at the last row), (V' dS)_j . k_j at
// the last row.
#include "cuda/chunk_backward_products.cuh"

namespace mlx_gated_delta::cuda {

namespace {

constexpr int kWarps = kBackwardChunkWarps;
constexpr int kTiles = kChunkTiles;
constexpr int kMaxTiles = kMaxRowTiles;

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

template <typename T, bool kScan>
__device__ __forceinline__ void chunk_wy_backward(
    const CoreArgs& a,
    const BackwardArgs& o,
    const ChunkScratch& s,
    const ChunkBackwardScratch& d) {
  extern __shared__ __align__(128) float shared[];
  constexpr bool kExact = kExactInTf32<T>;
  const int dk = a.key_dim, dv = a.value_dim;
  const int kw = tile_padded(dk), vw = tile_padded(dv);
  const int kp = tile_stride(dk), vp = tile_stride(dv);
  const int xp = max(kp, vp), lp = tile_stride(kChunk);
  float* ks = shared;  // [L][kp]: K
  float* xa = ks + kChunk * kp;  // [L][xp]: dy, Q, V, then dKb
  float* xb = xa + kChunk * xp;  // [L][xp]: V', dV', then dVb, dW
  float* gram = xb + kChunk * xp;  // [L][lp]: K K^T, normalised
  float* ld = gram + kChunk * lp;  // [L][lp]: dy V'^T, (dM o decay) diag(1/|k|), T, then D + D^T
  float* lq = ld + kChunk * lp;  // [L][lp]: Q K^T, diag(1/|q|) (dM o decay), then dT
  float* pairs = lq + kChunk * lp;  // [L][lp]: P_ij
  float* lx = pairs + kChunk * lp;  // [L][lp]: dW K^T, dT T^T, dA, then D
  float* decays = lx + kChunk * lp;  // [kDecayRows][L]
  float* query_scales = decays + kDecayRows * kChunk;
  float* row_scales = query_scales + kChunk;  // s_i
  float* betas = row_scales + kChunk;
  float* gammas = betas + kChunk;
  float* entry = gammas + kChunk;  // P_{i,-1}
  float* exit = entry + kChunk;  // P_{L-1,j}
  float* dbeta = exit + kChunk;
  const float* from_start = decays;
  const float* to_end = decays + kChunk;
  const float* log_sum = decays + 2 * kChunk;
  const float* last_wipe = decays + 3 * kChunk;
  const float* key_scales = decays + 4 * kChunk;

  const ChunkPlace place = chunk_place(a, blockIdx.x);
  const int length = place.length;
  const int kh = key_head_of(a, place.h);
  const int64_t bt0 = int64_t(place.b) * a.tokens + place.t0;
  const int64_t key_stride = int64_t(a.key_heads) * dk;
  const int64_t value_stride = int64_t(a.value_heads) * dv;
  const int chunks = (a.tokens + kChunk - 1) / kChunk;
  const int64_t key_chunk =
      (int64_t(place.b) * a.key_heads + kh) * chunks + place.chunk;
  float* dq_rows = d.dq + place.index * kChunk * kw;
  float* dk_rows = d.dk + place.index * kChunk * kw;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;

  // dM and the grams: K, dy and V'.
  copy_rows_async(s.k + key_chunk * kChunk * kw, kw, kChunk, kw, ks, kp);
  copy_rows_async(
      s.u + place.index * kChunk * vw, vw, kChunk, vw, xb, xp);
  copy_rows_async(
      s.decays + place.index * kDecayRows * kChunk, kChunk, kDecayRows, kChunk,
      decays, kChunk);
  __pipeline_commit();
  const T* dy = static_cast<const T*>(o.dy) +
      (bt0 * a.value_heads + place.h) * dv;
  load_rows(dy, value_stride, dv, length, false, nullptr, xa, xp);
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    const int64_t bt = bt0 + i;
    const bool active = i < length && (a.mask == nullptr || a.mask[bt]);
    const int64_t gate = bt * a.value_heads + place.h;
    row_scales[i] = active ? a.scale : 0.0f;
    betas[i] = active ? a.beta[gate] : 0.0f;
    gammas[i] = active ? expf(a.g[gate]) : 1.0f;
    dbeta[i] = 0.0f;
  }
  ChunkRows queries;
  queries.fetch(
      static_cast<const T*>(a.q) + (bt0 * a.key_heads + kh) * dk, key_stride,
      dk, length);
  __pipeline_wait_prior(0);
  __syncthreads();
  lower_gram<kExact, kExact>(ks, kp, ks, kp, kw, gram, lp);
  lower_gram<kExact, false>(xa, xp, xb, xp, vw, ld, lp);
  __syncthreads();
  queries.store(dk, length, a.normalize_qk, query_scales, xa, xp);
  __syncthreads();
  lower_gram<kExact, kExact>(xa, xp, ks, kp, kw, lq, lp);
  // chunk_state_products' rows: dq = s Gamma (dy S), entry terms s (dy S).q;
  // dk = e (V' dS), exit terms (V' dS).k. A warp per row.
  for (int i = warp; i < kChunk; i += kWarps) {
    float q_dot = 0.0f, k_dot = 0.0f;
    for (int c = lane; c < kw; c += kWarp) {
      q_dot += dq_rows[i * kw + c] * xa[i * xp + c];
      k_dot += dk_rows[i * kw + c] * ks[i * kp + c];
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
    pairs[i * lp + j] = j < i ? dm * qk : 0.0f;
    ld[i * lp + j] = dm * decay * key_scales[j];
    lq[i * lp + j] = query_scales[i] * dm * decay;
    gram[i * lp + j] *= key_scales[i] * key_scales[j];
  }
  __syncthreads();
  accumulate_rows<false, kExact>(dq_rows, kw, ld, lp, ks, kp);
  accumulate_rows<true, kExact>(dk_rows, kw, lq, lp, xa, xp);
  __syncthreads();

  // recompute_w_u_backward, U's side: dV', V and T.
  copy_rows_async(
      d.dv + place.index * kChunk * vw, vw, kChunk, vw, xb, xp);
  copy_rows_async(
      s.t + place.index * kChunk * kChunk, kChunk, kChunk, kChunk, ld, lp);
  __pipeline_commit();
  load_rows(
      static_cast<const T*>(a.v) + (bt0 * a.value_heads + place.h) * dv,
      value_stride, dv, length, false, nullptr, xa, xp);
  __pipeline_wait_prior(0);
  __syncthreads();
  lower_gram<false, kExact>(xb, xp, xa, xp, vw, lq, lp);  // dV' V^T
  inverse_transposed_times(ld, lp, xb, xp, vw, xb, xp);  // dVb
  __syncthreads();
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

  // W's side: dW.
  copy_rows_async(d.dw + place.index * kChunk * kw, kw, kChunk, kw, xb, xp);
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();
  lower_gram<false, kExact>(xb, xp, ks, kp, kw, lx, lp);  // dW K^T
  inverse_transposed_times(ld, lp, xb, xp, kw, xa, xp);  // dKb
  __syncthreads();
  for (int e = threadIdx.x; e < kChunk * kChunk; e += kChunkedThreads) {
    const int i = e / kChunk, j = e % kChunk;
    lq[i * lp + j] = j <= i
        ? betas[j] * (lq[i * lp + j] +
                      from_start[j] * key_scales[j] * lx[i * lp + j])
        : 0.0f;
  }
  for (int i = warp; i < kChunk; i += kWarps) {
    float dot = 0.0f;
    for (int c = lane; c < kw; c += kWarp) {
      dot += xa[i * xp + c] * ks[i * kp + c];
    }
    const float key_term = key_scales[i] * warp_sum(dot);
    const float w_scale = betas[i] * from_start[i];
    for (int c = lane; c < kw; c += kWarp) {
      dk_rows[i * kw + c] += w_scale * xa[i * xp + c];
    }
    if (lane == 0) {
      dbeta[i] += from_start[i] * key_term;
      entry[i] += betas[i] * key_term;
    }
  }
  __syncthreads();

  // kkt_inverse_backward: X = dT T^T (X_ij = sum_{m <= min(i, j)} dT_im
  // T_jm), then dA = -T^T X on the strictly lower triangle.
  {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int tile = warp + n * kWarps;
      const int ti = tile / kTiles, tj = tile % kTiles;
      Product product;
      for (int m0 = 0; m0 < (min(ti, tj) + 1) * kTile; m0 += 8) {
        product.add<wmma::row_major, wmma::col_major>(
            lq + ti * kTile * lp + m0, lp, ld + tj * kTile * lp + m0, lp);
      }
      wmma::store_matrix_sync(
          lx + ti * kTile * lp + tj * kTile, product.finish(), lp,
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
              ld + m0 * lp + ti * kTile, lp, lx + m0 * lp + tj * kTile, lp);
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
          lx + ti * kTile * lp + tj * kTile, da, lp, wmma::mem_row_major);
    }
  }
  __syncthreads();
  // A_ij = beta_i decay(i, j) k_i . k_j: its pair terms, dbeta, and
  // D = diag(beta) (dA o decay) over dA. A warp per row.
  for (int i = warp; i < kChunk; i += kWarps) {
    float dot = 0.0f;
    for (int j = lane; j < kChunk; j += kWarp) {
      float dak = 0.0f;
      if (j < i && i < length) {
        const float da = lx[i * lp + j];
        const float decay = chunk_decay(log_sum, last_wipe, i, j);
        const float kk = gram[i * lp + j];
        pairs[i * lp + j] += da * betas[i] * kk;
        dot += da * decay * kk;
        dak = betas[i] * decay * da;
      }
      lx[i * lp + j] = dak;
    }
    dot = warp_sum(dot);
    if (lane == 0) {
      dbeta[i] += dot;
    }
  }
  __syncthreads();
  // (D + D^T) diag(1/|k|), over T (read for the last time above).
  for (int e = threadIdx.x; e < kChunk * kChunk; e += kChunkedThreads) {
    const int i = e / kChunk, j = e % kChunk;
    ld[i * lp + j] = (lx[i * lp + j] + lx[j * lp + i]) * key_scales[j];
  }
  __syncthreads();
  {
    const int tiles = kTiles * (kw / kTile);
#pragma unroll
    for (int n = 0; n < kMaxTiles; ++n) {
      const int tile = warp + n * kWarps;
      if (tile < tiles) {
        const int ti = tile % kTiles, tc = tile / kTiles;
        float* at = dk_rows + ti * kTile * kw + tc * kTile;
        Product product;
        wmma::load_matrix_sync(product.sum, at, kw, wmma::mem_row_major);
        for (int j0 = 0; j0 < kChunk; j0 += 8) {
          product.add<wmma::row_major, wmma::row_major, false, kExact>(
              ld + ti * kTile * lp + j0, lp, ks + j0 * kp + tc * kTile, kp);
        }
        wmma::store_matrix_sync(at, product.finish(), kw, wmma::mem_row_major);
      }
    }
  }
  // The exit state's terms: decay(L-1, j) for j < L - 1, and Gamma_{L-1}'s
  // <dS, S>.
  if (threadIdx.x < length - 1) {
    pairs[(length - 1) * lp + threadIdx.x] += exit[threadIdx.x];
  }
  if (threadIdx.x == 0) {
    entry[length - 1] += (d.state_dots[kStateDotSlots * place.index] +
        d.state_dots[kStateDotSlots * place.index + 1]);
  }
  __syncthreads();

  // gate_cumsum_backward: dgamma_t = sum_{i >= t > j} P_ij decay(i, t)
  // decay(t-1, j) (j = -1: the entry terms), the decays as running
  // products of gamma (no exp: exact where gamma is tiny), a thread per t.
  float* partials = o.partials;
  const int width = backward_partial_width(dk, false);
  float d_gamma = 0.0f;
  if constexpr (kScan) {
    d_gamma = gate_cumsum_backward(pairs, lp, entry, gammas, length);
  } else if (threadIdx.x < length) {
    const int t = threadIdx.x;
    float to_i = 1.0f;
    for (int i = t; i < length; ++i) {
      if (i > t) {
        to_i *= gammas[i];
      }
      float carried = 0.0f, from_j = 1.0f;
      for (int j = t - 1; j >= 0; --j) {
        carried += pairs[i * lp + j] * from_j;
        from_j *= gammas[j];
      }
      carried += entry[i] * from_j;
      d_gamma += to_i * carried;
    }
  }
  if (threadIdx.x < length) {
    const int t = threadIdx.x;
    const int64_t bt = bt0 + t;
    const bool active = a.mask == nullptr || a.mask[bt];
    float* out = partials + (bt * a.value_heads + place.h) * width;
    out[2 * dk] = active ? d_gamma : 0.0f;
    out[2 * dk + 1] = active ? dbeta[t] : 0.0f;
  }
  __syncthreads();
  // dq and dk of the chunk's tokens (0 where masked), and dv's masked rows.
  for (int i = warp; i < length; i += kWarps) {
    const int64_t bt = bt0 + i;
    const bool active = a.mask == nullptr || a.mask[bt];
    float* out = partials + (bt * a.value_heads + place.h) * width;
    for (int c = lane; c < dk; c += kWarp) {
      out[c] = active ? dq_rows[i * kw + c] : 0.0f;
      out[dk + c] = active ? dk_rows[i * kw + c] : 0.0f;
    }
  }
}


// The WY form's terms alone, after chunk_qk_backward (which took the
// intra-chunk readout's: dq complete, dk's share, P_ij, the entry and exit
// terms), in two row buffers and two [L, L] ones, so that two blocks share
// a multiprocessor. W's side comes first (dT's dW K^T part), then U's (dV'
// V^T added onto it), then kkt_inverse_backward; K is loaded again over V
// while the kkt products run.
template <typename T>
__device__ __forceinline__ void chunk_wy_split(
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
  const float* k_rows = s.k +
      ((int64_t(place.b) * a.key_heads + kh) * chunks + place.chunk) * kChunk *
          kw;
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
    gammas[i] = active ? expf(a.g[gate]) : 1.0f;
    entry[i] = d.ends[place.index * 2 * kChunk + i];
    dbeta[i] = 0.0f;
  }
  __pipeline_wait_prior(0);
  __syncthreads();

  // recompute_w_u_backward, W's side: dW K^T, dKb = T^T dW (over dW).
  lower_gram<false, kExact>(xb, xp, xa, xp, kw, lq, lp);
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
      dk_rows[i * kw + c] += w_scale * xb[i * xp + c];
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
  // K again, over V, for K K^T and (D + D^T) K; it lands during the
  // products below.
  copy_rows_async(k_rows, kw, kChunk, kw, xa, xp);
  __pipeline_commit();

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
  // Gamma_{L-1}'s <dS, S>.
  if (threadIdx.x == 0) {
    entry[length - 1] += (d.state_dots[kStateDotSlots * place.index] +
        d.state_dots[kStateDotSlots * place.index + 1]);
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
  const int width = backward_partial_width(dk, false);
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
// (one kernel after chunk_state_products), EXPERIMENT: gd_chunk_wy_scan_<dtype>
// (the same with the scans of gate_cumsum_backward) and gd_chunk_wy_split_<dtype>
// (after chunk_qk_backward; two blocks a multiprocessor).
#define GD_CHUNK_WY_BACKWARD_ENTRY(type, suffix)                          \
  extern "C" __global__ void __launch_bounds__(                           \
      mlx_gated_delta::cuda::kChunkedThreads)                             \
      gd_chunk_wy_backward_##suffix(                                      \
          const mlx_gated_delta::cuda::CoreArgs a,                        \
          const mlx_gated_delta::cuda::BackwardArgs o,                    \
          const mlx_gated_delta::cuda::ChunkScratch s,                    \
          const mlx_gated_delta::cuda::ChunkBackwardScratch d) {          \
    mlx_gated_delta::cuda::chunk_wy_backward<type, false>(a, o, s, d);    \
  }                                                                       \
  extern "C" __global__ void __launch_bounds__(                           \
      mlx_gated_delta::cuda::kChunkedThreads)                             \
      gd_chunk_wy_scan_##suffix(                                          \
          const mlx_gated_delta::cuda::CoreArgs a,                        \
          const mlx_gated_delta::cuda::BackwardArgs o,                    \
          const mlx_gated_delta::cuda::ChunkScratch s,                    \
          const mlx_gated_delta::cuda::ChunkBackwardScratch d) {          \
    mlx_gated_delta::cuda::chunk_wy_backward<type, true>(a, o, s, d);     \
  }                                                                       \
  extern "C" __global__ void __launch_bounds__(                           \
      mlx_gated_delta::cuda::kChunkedThreads, 2)                          \
      gd_chunk_wy_split_##suffix(                                         \
          const mlx_gated_delta::cuda::CoreArgs a,                        \
          const mlx_gated_delta::cuda::BackwardArgs o,                    \
          const mlx_gated_delta::cuda::ChunkScratch s,                    \
          const mlx_gated_delta::cuda::ChunkBackwardScratch d) {          \
    mlx_gated_delta::cuda::chunk_wy_split<type>(a, o, s, d);              \
  }
GD_CHUNK_WY_BACKWARD_ENTRY(float, f32)
GD_CHUNK_WY_BACKWARD_ENTRY(__half, f16)
GD_CHUNK_WY_BACKWARD_ENTRY(__nv_bfloat16, bf16)
