// The backward of the core op on CUDA, in the recurrent form (stages
// boundary_states, chunk_states, recurrent_chunk_backward and qk_grad_reduce
// of docs/stages.md), with the formulas of the CPU's recurrent backward
// (csrc/cpu/recurrent_backward.cpp): per active token, a = exp(g),
//   Sd = a S_prev;  p = Sd k;  d = beta (v - p);  S = Sd + d k^T;  y = scale S q
// and in reverse, with dS the cotangent of S:
//   dS += scale dy q^T;  dq = scale S^T dy;  dd = dS k;  dp = -beta dd;
//   dv = beta dd;  dbeta = dd . (v - p);  dk = dS^T d + a S_prev^T dp;
//   dSd = dS + dp k^T;  da = <dSd, S_prev>;  dg = a da;  dS_prev = a dSd.
//
// recurrent_backward: one block per (value head, batch row) holds the whole
// state; each warp owns kBackwardRowsPerWarp of its rows, each lane the
// columns c = lane + 32 j of those rows. Every row of S and of dS evolves on
// its own (given k, q, the gates and its entries of v and dy), so a warp
// steps its rows without the other warps; what couples the rows are the sums
// over rows of dq, dk, da and dbeta, which each warp forms for its rows and
// the block adds up in shared memory, warp by warp in a fixed order (the same
// inputs give the same bits). The block:
//   1. runs the forward once, writing the state entering each 64-token chunk
//      to `boundaries` (T / 64 states);
//   2. for each chunk, last first: steps the forward through the chunk from
//      its boundary state, writing the state before each token to
//      `chunk_states` (64 states), then reverses the chunk's tokens, last
//      first, carrying dS in registers; the state after a token is the one in
//      registers, the state before it is read back.
// Every lane reads back only what it wrote itself, so the scratch needs no
// barrier. qk_grad_reduce then sums the per-value-head gradients of q and k
// over the value heads that read each key head and takes them through the L2
// norm of normalize_qk, as the CPU does (its two dot products in float64).
#include "cuda/device_common.cuh"
#include "cuda/launch_shapes.h"

namespace mlx_gated_delta::cuda {

namespace {

constexpr int kRows = kBackwardRowsPerWarp;

__device__ inline double warp_sum_double(double x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

// A q or k vector of one token in the lane's columns, L2-normalised when the
// call asks for it.
template <typename T, int kColumns>
__device__ __forceinline__ void load_vector(
    const T* source, int dk, bool normalize, int lane, float (&x)[kColumns]) {
  float squares = 0.0f;
#pragma unroll
  for (int j = 0; j < kColumns; ++j) {
    const int c = lane + kWarp * j;
    x[j] = c < dk ? to_float(source[c]) : 0.0f;
    squares += x[j] * x[j];
  }
  if (normalize) {
    const float scale = inverse_norm(warp_sum(squares));
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      x[j] *= scale;
    }
  }
}

template <int kColumns>
__device__ __forceinline__ void load_rows(
    const float* state,
    int row0,
    int dv,
    int dk,
    int lane,
    float (&s)[kRows][kColumns]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = row0 + i;
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      const int c = lane + kWarp * j;
      s[i][j] = (r < dv && c < dk) ? state[int64_t(r) * dk + c] : 0.0f;
    }
  }
}

template <int kColumns>
__device__ __forceinline__ void store_rows(
    float* state,
    int row0,
    int dv,
    int dk,
    int lane,
    const float (&s)[kRows][kColumns]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = row0 + i;
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      const int c = lane + kWarp * j;
      if (r < dv && c < dk) {
        state[int64_t(r) * dk + c] = s[i][j];
      }
    }
  }
}

// One token of the forward on the warp's rows (a masked token leaves them).
template <typename T, int kColumns>
__device__ __forceinline__ void forward_token(
    const CoreArgs& a,
    int b,
    int h,
    int kh,
    int t,
    int row0,
    int lane,
    float (&s)[kRows][kColumns]) {
  const int64_t bt = int64_t(b) * a.tokens + t;
  if (a.mask != nullptr && !a.mask[bt]) {
    return;
  }
  const int dk = a.key_dim, dv = a.value_dim;
  float k[kColumns];
  load_vector<T, kColumns>(
      static_cast<const T*>(a.k) + (bt * a.key_heads + kh) * dk,
      dk,
      a.normalize_qk,
      lane,
      k);
  const int64_t gate = bt * a.value_heads + h;
  const float decay = expf(a.g[gate]);
  const float beta = a.beta[gate];
  const T* v = static_cast<const T*>(a.v) + gate * dv;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = row0 + i;
    float partial = 0.0f;
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      partial += s[i][j] * k[j];
    }
    const float predicted = decay * warp_sum(partial);
    const float v_r = r < dv ? to_float(v[r]) : 0.0f;
    const float delta = beta * (v_r - predicted);
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      s[i][j] = decay * s[i][j] + delta * k[j];
    }
  }
}

template <typename T, int kColumns>
__device__ __forceinline__ void recurrent_backward(
    const CoreArgs& a, const BackwardArgs& o) {
  // Each warp's partial sums for one token: dq and dk per column, then da and
  // dbeta. Two buffers, one per token parity, so that one barrier per token
  // orders the writes of a token after the reads of the token before.
  __shared__ float partials[2][kBackwardWarps][2 * kBackwardMaxDim + 2];

  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int h = blockIdx.x;
  const int b = blockIdx.y;
  const int kh = key_head_of(a, h);
  const int dk = a.key_dim, dv = a.value_dim;
  const int row0 = warp * kRows;
  const int64_t state_size = int64_t(dv) * dk;
  const int64_t head = int64_t(b) * a.value_heads + h;
  const int chunks = (a.tokens + kChunk - 1) / kChunk;
  float* boundaries = o.boundaries + head * chunks * state_size;
  float* before = o.chunk_states + head * kChunk * state_size;

  // boundary_states (the last chunk's tokens are stepped again below).
  float s[kRows][kColumns];
  load_rows(a.state_in + head * state_size, row0, dv, dk, lane, s);
  for (int c = 0; c < chunks; ++c) {
    store_rows(boundaries + c * state_size, row0, dv, dk, lane, s);
    if (c + 1 < chunks) {
      for (int t = c * kChunk; t < (c + 1) * kChunk; ++t) {
        forward_token<T, kColumns>(a, b, h, kh, t, row0, lane, s);
      }
    }
  }

  float ds[kRows][kColumns];
  load_rows(o.state_cotangent + head * state_size, row0, dv, dk, lane, ds);
  const T* dy_all = static_cast<const T*>(o.dy);
  const T* v_all = static_cast<const T*>(a.v);
  T* dv_all = static_cast<T*>(o.dv);
  int parity = 0;
  for (int c = chunks - 1; c >= 0; --c) {
    const int start = c * kChunk;
    const int length = min(kChunk, a.tokens - start);
    // chunk_states
    load_rows(boundaries + c * state_size, row0, dv, dk, lane, s);
    for (int i = 0; i < length; ++i) {
      store_rows(before + i * state_size, row0, dv, dk, lane, s);
      forward_token<T, kColumns>(a, b, h, kh, start + i, row0, lane, s);
    }
    // recurrent_chunk_backward: s holds the state after token i.
    for (int i = length - 1; i >= 0; --i) {
      const int64_t bt = int64_t(b) * a.tokens + start + i;
      const int64_t gate = bt * a.value_heads + h;
      const int64_t head_grad = gate * dk;
      if (a.mask != nullptr && !a.mask[bt]) {
        // A skipped token: the state and dS pass through, no gradients.
        for (int x = threadIdx.x; x < dk; x += kBackwardThreads) {
          o.dq_heads[head_grad + x] = 0.0f;
          o.dk_heads[head_grad + x] = 0.0f;
        }
        for (int x = threadIdx.x; x < dv; x += kBackwardThreads) {
          dv_all[gate * dv + x] = from_float<T>(0.0f);
        }
        if (threadIdx.x == 0) {
          o.dg[gate] = 0.0f;
          o.dgamma[gate] = 0.0f;
          o.dbeta[gate] = 0.0f;
        }
        continue;
      }
      const int64_t qk_row = (bt * a.key_heads + kh) * dk;
      float q[kColumns], k[kColumns];
      load_vector<T, kColumns>(
          static_cast<const T*>(a.q) + qk_row, dk, a.normalize_qk, lane, q);
      load_vector<T, kColumns>(
          static_cast<const T*>(a.k) + qk_row, dk, a.normalize_qk, lane, k);
      const float decay = expf(a.g[gate]);
      const float beta = a.beta[gate];
      const float* previous = before + i * state_size;
      float dq[kColumns] = {}, dk_sum[kColumns] = {};
      float dgamma = 0.0f, dbeta = 0.0f;
#pragma unroll
      for (int n = 0; n < kRows; ++n) {
        const int r = row0 + n;
        const bool row = r < dv;
        const float dy_scaled =
            row ? a.scale * to_float(dy_all[gate * dv + r]) : 0.0f;
        const float v_r = row ? to_float(v_all[gate * dv + r]) : 0.0f;
        float old[kColumns];
        float dd_part = 0.0f, old_k_part = 0.0f;
#pragma unroll
        for (int j = 0; j < kColumns; ++j) {
          const int col = lane + kWarp * j;
          old[j] = (row && col < dk) ? previous[int64_t(r) * dk + col] : 0.0f;
          ds[n][j] += dy_scaled * q[j];
          dq[j] += dy_scaled * s[n][j];
          dd_part += ds[n][j] * k[j];
          old_k_part += old[j] * k[j];
        }
        const float dd = warp_sum(dd_part);
        const float residual = v_r - decay * warp_sum(old_k_part);  // v - p
        const float delta = beta * residual;
        const float dp = -beta * dd;
        if (lane == 0 && row) {
          dv_all[gate * dv + r] = from_float<T>(beta * dd);
        }
        dbeta += dd * residual;
        float dsd_old = 0.0f;
#pragma unroll
        for (int j = 0; j < kColumns; ++j) {
          dk_sum[j] += delta * ds[n][j] + decay * dp * old[j];
          const float dsd = ds[n][j] + dp * k[j];
          dsd_old += dsd * old[j];
          ds[n][j] = decay * dsd;
          s[n][j] = old[j];  // the state before this token
        }
        dgamma += warp_sum(dsd_old);
      }
      float* mine = partials[parity][warp];
#pragma unroll
      for (int j = 0; j < kColumns; ++j) {
        const int col = lane + kWarp * j;
        if (col < dk) {
          mine[col] = dq[j];
          mine[kBackwardMaxDim + col] = dk_sum[j];
        }
      }
      if (lane == 0) {
        mine[2 * kBackwardMaxDim] = dgamma;
        mine[2 * kBackwardMaxDim + 1] = dbeta;
      }
      __syncthreads();
      const int x = threadIdx.x;
      const bool column = x < dk || (x >= kBackwardMaxDim && x < kBackwardMaxDim + dk);
      if (column || x == 2 * kBackwardMaxDim || x == 2 * kBackwardMaxDim + 1) {
        float sum = 0.0f;
        for (int w = 0; w < kBackwardWarps; ++w) {
          sum += partials[parity][w][x];
        }
        if (x < dk) {
          o.dq_heads[head_grad + x] = sum;
        } else if (column) {
          o.dk_heads[head_grad + x - kBackwardMaxDim] = sum;
        } else if (x == 2 * kBackwardMaxDim) {
          o.dgamma[gate] = sum;
          o.dg[gate] = decay * sum;  // exactly 0 at a wipe
        } else {
          o.dbeta[gate] = sum;
        }
      }
#ifndef GD_SANITIZER_PROBE
      parity ^= 1;  // the probe reuses one buffer: a race racecheck reports
#endif
    }
  }
  store_rows(o.dstate + head * state_size, row0, dv, dk, lane, ds);
}

// qk_grad_reduce for one (batch row, token, key head) per warp: the gradient
// of the normalised vector summed over its value heads, then through x / n,
// n = sqrt(x.x + eps): (c n^2 - x (x.c)) / n^3, the two dot products and the
// difference in float64 (they cancel along x).
template <typename T>
__device__ __forceinline__ void qk_grad_reduce(
    const CoreArgs& a,
    const float* head_grads,
    const T* raw,
    T* out,
    int64_t row,
    int lane) {
  constexpr int kColumns = kBackwardMaxDim / kWarp;
  const int dk = a.key_dim;
  const int kh = int(row % a.key_heads);
  const int64_t bt = row / a.key_heads;
  const int ratio = a.value_heads / a.key_heads;
  float sum[kColumns] = {}, x[kColumns] = {};
  double squares = 0.0, projection = 0.0;
#pragma unroll
  for (int j = 0; j < kColumns; ++j) {
    const int c = lane + kWarp * j;
    if (c >= dk) {
      continue;
    }
    for (int n = 0; n < ratio; ++n) {
      const int head = a.grouped ? kh * ratio + n : kh + n * a.key_heads;
      sum[j] += head_grads[(bt * a.value_heads + head) * dk + c];
    }
    x[j] = to_float(raw[row * dk + c]);
    squares += double(x[j]) * x[j];
    projection += double(x[j]) * sum[j];
  }
  if (a.normalize_qk) {
    const double norm_squared = warp_sum_double(squares) + double(1e-6f);
    const double inverse_cube = 1.0 / (norm_squared * sqrt(norm_squared));
    projection = warp_sum_double(projection);
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      sum[j] =
          float((sum[j] * norm_squared - x[j] * projection) * inverse_cube);
    }
  }
#pragma unroll
  for (int j = 0; j < kColumns; ++j) {
    const int c = lane + kWarp * j;
    if (c < dk) {
      out[row * dk + c] = from_float<T>(sum[j]);
    }
  }
}

template <typename T>
__device__ __forceinline__ void qk_grad_reduce_rows(
    const CoreArgs& a, const BackwardArgs& o) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row =
      int64_t(blockIdx.x) * kReduceWarps + threadIdx.x / kWarp;
  if (row >= int64_t(a.batch) * a.tokens * a.key_heads) {
    return;
  }
  qk_grad_reduce<T>(
      a, o.dq_heads, static_cast<const T*>(a.q), static_cast<T*>(o.dq), row,
      lane);
  qk_grad_reduce<T>(
      a, o.dk_heads, static_cast<const T*>(a.k), static_cast<T*>(o.dk), row,
      lane);
}

}  // namespace

}  // namespace mlx_gated_delta::cuda

// The entry points the executor looks up by name (launch_shapes.h):
// gd_recurrent_backward_<dtype>_c<columns> and gd_qk_grad_reduce_<dtype>.
#define GD_BACKWARD_ENTRY(type, suffix, columns)                 \
  extern "C" __global__ void __launch_bounds__(                  \
      mlx_gated_delta::cuda::kBackwardThreads)                   \
      gd_recurrent_backward_##suffix##_c##columns(               \
          const mlx_gated_delta::cuda::CoreArgs a,               \
          const mlx_gated_delta::cuda::BackwardArgs o) {         \
    mlx_gated_delta::cuda::recurrent_backward<type, columns>(a, o); \
  }
#define GD_BACKWARD_ENTRIES(type, suffix)                         \
  GD_BACKWARD_ENTRY(type, suffix, 1)                              \
  GD_BACKWARD_ENTRY(type, suffix, 2)                              \
  GD_BACKWARD_ENTRY(type, suffix, 3)                              \
  GD_BACKWARD_ENTRY(type, suffix, 4)                              \
  extern "C" __global__ void __launch_bounds__(                   \
      32 * mlx_gated_delta::cuda::kReduceWarps)                   \
      gd_qk_grad_reduce_##suffix(                                 \
          const mlx_gated_delta::cuda::CoreArgs a,                \
          const mlx_gated_delta::cuda::BackwardArgs o) {          \
    mlx_gated_delta::cuda::qk_grad_reduce_rows<type>(a, o);       \
  }
GD_BACKWARD_ENTRIES(float, f32)
GD_BACKWARD_ENTRIES(__half, f16)
GD_BACKWARD_ENTRIES(__nv_bfloat16, bf16)
