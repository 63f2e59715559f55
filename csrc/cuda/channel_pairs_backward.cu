// channel_pairs_backward: the per-key gates' last stage of the chunked
// backward, every chunk at once, one block per (chunk, value head, batch
// row), after chunk_wy_backward (chunk_wy_backward.cu). With a decay per key
// channel, decay_c(i, j), every product of the chunk that carries one is
// taken here per channel c, a thread per channel walking the chunk's pairs
// (i, j), j <= i, with the decays as running products of the gates (no
// exponential, exact where a gate is tiny, 0 past a wipe):
//   chunk_output_backward's intra-chunk terms, with dM = diag(s) dy V'^T
//   (chunk_qk_backward): dq_ic += sum_j dM_ij k_jc decay_c(i, j) (R) and
//   dk_jc += sum_i dM_ij q_ic decay_c(i, j) (C);
//   kkt_inverse_backward's, A_ij = beta_i sum_c k_ic k_jc decay_c(i, j):
//   dk_ic += beta_i (dA K)_ic (R, and dbeta_i += k_i . (dA K)_i) and
//   dk_jc += sum_i beta_i dA_ij k_ic decay_c(i, j) (C);
//   the entry state's and W's shares of dq and dk, which take
//   decay_c(i, -1), and the exit state's of dk, decay_c(L - 1, j);
//   gate_cumsum_backward per channel: dgamma_tc from the pair terms
//   P_ijc = (dM_ij q_ic + beta_i dA_ij k_ic) k_jc, the entry terms
//   P_{i,-1,c} = s_i q_ic (dy S)_ic + beta_i k_ic dKb_ic (+ <dS, S>_c at the
//   last row) and the exit terms P_{L-1,j,c} = k_jc (V' dS)_jc, by the scan
//   of chunk_wy_backward's gate_cumsum_backward for each channel.
// q and k are the normalised rows. It writes dq, dk, dgamma and dbeta of
// each token into the partial sums (BackwardArgs::partials, one block), which
// qk_grad_reduce takes through the head mapping and qk_norm. The same sums as
// the CPU's per-key stages (csrc/cpu/key_chunked_backward.cpp), whose
// products run as sub-chunk matrix products instead.
#include "cuda/chunked_common.cuh"

namespace mlx_gated_delta::cuda {

namespace {

// Rows of a chunk a thread takes together.
constexpr int kPairRows = 8;

// One row i of channel_pairs_backward's walk, a thread's channel c: its q_ic,
// k_ic, beta_i and gamma_ic, its readout (dy S)_ic and dKb_ic, decay_c(i, -1),
// the scan's C_it and the sums over its pairs of dq's (dM K) and (dA K).
struct PairRow {
  float q, k, beta, gamma, readout, key_blocks, from_start;
  float scan, query_sum, key_sum;

  // The pair (i, t), t <= i (the scan stops at t = i): decay = decay_c(i, t),
  // dm = dM_it, da = dA_it; dgamma_t's and dk_t's terms into the sums of t.
  __device__ void pair(
      float decay, float dm, float da, float k_t, float gamma_t,
      float& gamma_sum, float& key_sum_t) {
    const float u = dm * q + beta * da * k;
    gamma_sum += decay * scan;
    key_sum_t += decay * u;
    query_sum += decay * dm * k_t;
    key_sum += decay * da * k_t;
    scan = k_t * u + gamma_t * scan;
  }
};

template <typename T>
__device__ __forceinline__ void channel_pairs_backward(
    const CoreArgs& a,
    const BackwardArgs& o,
    const ChunkScratch& s,
    const ChunkBackwardScratch& d) {
  extern __shared__ __align__(128) float shared[];
  const int dk = a.key_dim;
  const int kw = tile_padded(dk);
  const int lp = tile_stride(kChunk);
  // The arrays do not overlap (__restrict__): the compiler may then issue a
  // step's loads before the step before has stored.
  float* __restrict__ dms = shared;  // [L][lp]: dM
  float* __restrict__ das = dms + kChunk * lp;  // [L][lp]: dA
  // [L][kw] each, a channel a column: k (normalised), the gates gamma (1 where
  // masked), decay(i, t) of the row in hand, dgamma, dk.
  float* __restrict__ keys = das + kChunk * lp;
  float* __restrict__ gammas = keys + kChunk * kw;
  float* __restrict__ to_row = gammas + kChunk * kw;
  float* __restrict__ d_gamma = to_row + kChunk * kw;
  float* __restrict__ d_key = d_gamma + kChunk * kw;
  float* betas = d_key + kChunk * kw;  // [L]
  float* row_scales = betas + kChunk;  // [L]: s_i
  float* query_scales = row_scales + kChunk;  // [L]: 1 / |q_i|, else 1
  float* key_scales = query_scales + kChunk;  // [L]: likewise

  const ChunkPlace place = chunk_place(a, blockIdx.x);
  const int length = place.length;
  const int kh = key_head_of(a, place.h);
  const int64_t bt0 = int64_t(place.b) * a.tokens + place.t0;
  const int64_t rows_at = place.index * kChunk * kw;
  const int width = backward_partial_width(dk, true);
  const T* q = static_cast<const T*>(a.q) + (bt0 * a.key_heads + kh) * dk;
  const int64_t key_stride = int64_t(a.key_heads) * dk;

  copy_rows_async(
      d.pairs + place.index * kChunk * kChunk, kChunk, kChunk, kChunk, dms, lp);
  copy_rows_async(
      d.da + place.index * kChunk * kChunk, kChunk, kChunk, kChunk, das, lp);
  __pipeline_commit();
  // K normalised into `keys`; of Q only the rows' scales (each thread reads
  // its channel of q_i from memory below).
  ChunkRows rows;
  rows.fetch(
      static_cast<const T*>(a.k) + (bt0 * a.key_heads + kh) * dk, key_stride,
      dk, length);
  rows.store(dk, length, a.normalize_qk, key_scales, keys, kw);
  rows.fetch(q, key_stride, dk, length);
  rows.store_scales(length, a.normalize_qk, query_scales);
  __syncthreads();
  // The gates' loads all issued before their first use (unrolled).
#pragma unroll 8
  for (int e = threadIdx.x; e < kChunk * dk; e += kChunkedThreads) {
    const int t = e / dk, c = e % dk;
    keys[t * kw + c] *= key_scales[t];
    const bool active = t < length && (a.mask == nullptr || a.mask[bt0 + t]);
    gammas[t * kw + c] = active
        ? expf(a.g[((bt0 + t) * a.value_heads + place.h) * dk + c])
        : 1.0f;
  }
  __syncthreads();
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    const int64_t gate = (bt0 + i) * a.value_heads + place.h;
    const bool active = i < length && (a.mask == nullptr || a.mask[bt0 + i]);
    betas[i] = active ? a.beta[gate] : 0.0f;
    row_scales[i] = active ? a.scale : 0.0f;
  }
  __pipeline_wait_prior(0);
  __syncthreads();

  const int c = threadIdx.x;
  if (c < dk) {
    const float* dy_state = d.dq + rows_at + c;  // (dy S)_ic at [i * kw]
    const float* values_exit = d.dk + rows_at + c;  // (V' dS)_jc
    float* w_rows = d.dw + rows_at + c;  // dKb_ic, then k_ic (dA K)_ic
    // The exit state's shares first: dk's, decay_c(L - 1, j) (V' dS)_jc,
    // and the terms P_{L-1,j} = k_j (V' dS)_j of the last row's scan (linear
    // in its terms, so run apart): dgamma_t += decay(L - 1, t) C_t, C_0 = 0,
    // C_{t+1} = P_{L-1,t} + gamma_t C_t. to_row holds decay(L - 1, t) and
    // d_gamma V' dS meanwhile; the loads of V' dS all in flight at once.
    float to_end = 1.0f;
#pragma unroll 8
    for (int t = length - 1; t >= 0; --t) {
      const float exit = values_exit[t * kw];
      d_key[t * kw + c] = to_end * exit;
      d_gamma[t * kw + c] = exit;
      to_row[t * kw + c] = to_end;
      to_end *= gammas[t * kw + c];
    }
    float exit_scan = 0.0f;
    for (int t = 0; t < length; ++t) {
      const float exit = d_gamma[t * kw + c];
      d_gamma[t * kw + c] = to_row[t * kw + c] * exit_scan;
      exit_scan = keys[t * kw + c] * exit + gammas[t * kw + c] * exit_scan;
    }
    // The rows kPairRows at a time, each its own scan (independent chains),
    // so that the pairs' loads and the sums' stores serve them all. Rows past
    // the chunk's tokens are zeros with gamma 1.
    float from_start = 1.0f;  // decay_c(i, -1)
    for (int i0 = 0; i0 < length; i0 += kPairRows) {
      PairRow rows[kPairRows];
#pragma unroll
      for (int r = 0; r < kPairRows; ++r) {
        const int i = i0 + r;
        const bool inside = i < length;
        PairRow& row = rows[r];
        row.gamma = gammas[i * kw + c];
        from_start *= row.gamma;
        row.from_start = from_start;
        row.beta = betas[i];
        row.q = inside && row_scales[i] != 0.0f
            ? to_float(q[int64_t(i) * key_stride + c]) * query_scales[i]
            : 0.0f;
        row.k = keys[i * kw + c];
        row.readout = inside ? dy_state[i * kw] : 0.0f;
        row.key_blocks = inside ? w_rows[i * kw] : 0.0f;
        // The entry terms P_{i,-1} (the scan's C_i0), with <dS, S> at the
        // last row.
        row.scan = row_scales[i] * row.q * row.readout +
            row.beta * row.k * row.key_blocks;
        if (i == length - 1) {
          row.scan += d.state_dots[place.index * kw + c];
        }
        row.query_sum = 0.0f;
        row.key_sum = 0.0f;
      }
      // The pairs left of the block, t < i0: to_row[t] = decay(i0 - 1, t)
      // becomes decay(i0 + kPairRows - 1, t).
#pragma unroll 2
      for (int t = 0; t < i0; ++t) {
        const float k_t = keys[t * kw + c], gamma_t = gammas[t * kw + c];
        float decay = to_row[t * kw + c], gamma_sum = 0.0f, key_sum = 0.0f;
#pragma unroll
        for (int r = 0; r < kPairRows; ++r) {
          decay *= rows[r].gamma;
          rows[r].pair(decay, dms[(i0 + r) * lp + t], das[(i0 + r) * lp + t],
                       k_t, gamma_t, gamma_sum, key_sum);
        }
        to_row[t * kw + c] = decay;
        d_gamma[t * kw + c] += gamma_sum;
        d_key[t * kw + c] += key_sum;
      }
      // The block's own triangle: row r pairs with t = i0 + tr for tr < r,
      // then its diagonal (decay 1; dA has none, and the scan stops there).
#pragma unroll
      for (int tr = 0; tr < kPairRows; ++tr) {
        const int t = i0 + tr;
        const float k_t = keys[t * kw + c], gamma_t = gammas[t * kw + c];
        float decay = 1.0f, gamma_sum = 0.0f, key_sum = 0.0f;
#pragma unroll
        for (int r = tr; r < kPairRows; ++r) {
          if (r > tr) {
            decay *= rows[r].gamma;
          }
          rows[r].pair(decay, dms[(i0 + r) * lp + t], das[(i0 + r) * lp + t],
                       k_t, gamma_t, gamma_sum, key_sum);
        }
        to_row[t * kw + c] = decay;
        d_gamma[t * kw + c] += gamma_sum;
        d_key[t * kw + c] += key_sum;
      }
#pragma unroll
      for (int r = 0; r < kPairRows; ++r) {
        const int i = i0 + r;
        const PairRow& row = rows[r];
        if (i < length) {
          const float dq =
              row_scales[i] * row.from_start * row.readout + row.query_sum;
          d_key[i * kw + c] +=
              row.beta * (row.key_sum + row.from_start * row.key_blocks);
          w_rows[i * kw] = row.k * row.key_sum;
          const int64_t bt = bt0 + i;
          const bool active = a.mask == nullptr || a.mask[bt];
          o.partials[(bt * a.value_heads + place.h) * width + c] =
              active ? dq : 0.0f;
        }
      }
    }
  }
  __syncthreads();
  // dk and dgamma of the chunk's tokens, then dbeta: chunk_wy_backward's
  // share plus k_i . (dA K)_i, a warp per row (0 where masked).
  for (int e = threadIdx.x; e < length * dk; e += kChunkedThreads) {
    const int t = e / dk, ch = e % dk;
    const int64_t bt = bt0 + t;
    const bool active = a.mask == nullptr || a.mask[bt];
    float* out = o.partials + (bt * a.value_heads + place.h) * width;
    out[dk + ch] = active ? d_key[t * kw + ch] : 0.0f;
    out[2 * dk + ch] = active ? d_gamma[t * kw + ch] : 0.0f;
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int t = warp; t < length; t += kChunkedThreads / kWarp) {
    float sum = 0.0f;
    for (int ch = lane; ch < dk; ch += kWarp) {
      sum += d.dw[rows_at + t * kw + ch];
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      const int64_t bt = bt0 + t;
      const bool active = a.mask == nullptr || a.mask[bt];
      float* out = o.partials + (bt * a.value_heads + place.h) * width;
      out[3 * dk] = active ? out[3 * dk] + sum : 0.0f;
    }
  }
}

}  // namespace

}  // namespace mlx_gated_delta::cuda

// The entry points the executor looks up by name:
// gd_channel_pairs_backward_<dtype> (one block a multiprocessor: its shared
// memory is about 194 KiB at Dk = 128).
#define GD_CHANNEL_PAIRS_BACKWARD_ENTRY(type, suffix)                 \
  extern "C" __global__ void __launch_bounds__(                       \
      mlx_gated_delta::cuda::kChunkedThreads)                         \
      gd_channel_pairs_backward_##suffix(                             \
          const mlx_gated_delta::cuda::CoreArgs a,                    \
          const mlx_gated_delta::cuda::BackwardArgs o,                \
          const mlx_gated_delta::cuda::ChunkScratch s,                \
          const mlx_gated_delta::cuda::ChunkBackwardScratch d) {      \
    mlx_gated_delta::cuda::channel_pairs_backward<type>(a, o, s, d);  \
  }
GD_CHANNEL_PAIRS_BACKWARD_ENTRY(float, f32)
GD_CHANNEL_PAIRS_BACKWARD_ENTRY(__half, f16)
GD_CHANNEL_PAIRS_BACKWARD_ENTRY(__nv_bfloat16, bf16)
