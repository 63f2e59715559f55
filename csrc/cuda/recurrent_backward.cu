// The backward of the core op on CUDA, in the recurrent form (stages
// boundary_states, chunk_states, recurrent_chunk_backward and qk_grad_reduce
// of docs/stages.md), with the formulas of the CPU's recurrent backward
// (csrc/cpu/recurrent_backward.cpp): per active token, with a the decay of
// each state column (exp(g), the same for every column with scalar gates),
//   Sd = S_prev diag(a);  p = Sd k;  d = beta (v - p);  S = Sd + d k^T;
//   y = scale S q
// and in reverse, with dS the cotangent of S:
//   dS += scale dy q^T;  dq = scale S^T dy;  dd = dS k;  dp = -beta dd;
//   dv = beta dd;  dbeta = dd . (v - p);  dk = dS^T d + diag(a) S_prev^T dp;
//   dSd = dS + dp k^T;  da_c = <dSd[:, c], S_prev[:, c]>;  dg_c = a_c da_c;
//   dS_prev = dSd diag(a)
// (scalar gates: one da, the sum of da_c over the columns).
//
// Every row of S and of dS evolves on its own, given k, q, the gates and its
// entries of v and dy; what couples the rows are the sums over rows of dq,
// dk, da and dbeta. So recurrent_backward spreads each (value head, batch
// row) over several blocks, kBackwardRowsPerBlock rows each: each warp owns
// kBackwardRowsPerWarp rows, each lane the columns c = lane + 32 j of those
// rows, in registers. Per token each warp forms its rows' share of the sums,
// the block adds its warps' shares in shared memory, warp by warp, and
// writes that to `partials`; qk_grad_reduce then adds the blocks' shares of
// a head in a fixed order. No atomics: the same inputs give the same bits.
//
// A block:
//   1. runs the forward once over its rows, writing their state entering
//      each 64-token chunk to `boundaries` (T / 64 states);
//   2. for each chunk, last first: steps the forward through the chunk from
//      its boundary state, writing the state before each token to
//      `chunk_states` (64 states), then reverses the chunk's tokens, last
//      first, carrying dS in registers; the state after a token is the one
//      in registers, the state before it is read back (a token ahead, so
//      that the read is under way while the token before is reversed).
// Each lane reads back only what it wrote itself, so that scratch needs no
// barrier. The chunk's inputs (q and k normalised, the decays, beta, the
// mask, the block's rows of v and dy) are staged in shared memory once per
// chunk, so that the per-token chain reads no global memory but the states.
#include "cuda/device_common.cuh"
#include "cuda/launch_shapes.h"

namespace mlx_gated_delta::cuda {

namespace {

constexpr int kRows = kBackwardRowsPerWarp;
constexpr int kBlockRows = kBackwardRowsPerBlock;

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

// The chunk's inputs in shared memory (backward_shared_floats's layout), per
// token i of the chunk: q and k (normalised; stride kColumns * 32, the
// columns past Dk zero), the decay (per column with per-key gates), beta,
// whether the token is active (1 or 0), and the block's rows of v and of
// scale dy; then the warps' per-token sums, two buffers (one per token
// parity, so that one barrier per token orders the writes of a token after
// the reads of the token before).
struct Staged {
  float* q;
  float* k;
  float* decay;
  float* beta;
  float* active;
  float* v;
  float* dy;
  float* partials;
};

template <int kColumns, bool kPerKey>
__device__ __forceinline__ Staged staged_layout(float* shared) {
  constexpr int stride = kColumns * kWarp;
  Staged s;
  s.q = shared;
  s.k = s.q + kChunk * stride;
  s.decay = s.k + kChunk * stride;
  s.beta = s.decay + kChunk * (kPerKey ? stride : 1);
  s.active = s.beta + kChunk;
  s.v = s.active + kChunk;
  s.dy = s.v + kChunk * kBlockRows;
  s.partials = s.dy + kChunk * kBlockRows;
  return s;
}

// Stages tokens [start, start + length) for the block's rows [first, first +
// kBlockRows); q and dy only for the reverse (`readout`).
template <typename T, int kColumns, bool kPerKey>
__device__ __forceinline__ void stage_chunk(
    const CoreArgs& a,
    const BackwardArgs& o,
    const Staged& s,
    int b,
    int h,
    int kh,
    int first,
    int start,
    int length,
    bool readout) {
  constexpr int stride = kColumns * kWarp;
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int dk = a.key_dim, dv = a.value_dim;
  for (int i = warp; i < length; i += kBackwardWarps) {
    const int64_t bt = int64_t(b) * a.tokens + start + i;
    const int64_t gate = bt * a.value_heads + h;
    const int64_t qk_row = (bt * a.key_heads + kh) * dk;
    float x[kColumns];
    load_vector<T, kColumns>(
        static_cast<const T*>(a.k) + qk_row, dk, a.normalize_qk, lane, x);
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      s.k[i * stride + lane + kWarp * j] = x[j];
    }
    if (readout) {
      load_vector<T, kColumns>(
          static_cast<const T*>(a.q) + qk_row, dk, a.normalize_qk, lane, x);
#pragma unroll
      for (int j = 0; j < kColumns; ++j) {
        s.q[i * stride + lane + kWarp * j] = x[j];
      }
    }
    if constexpr (kPerKey) {
#pragma unroll
      for (int j = 0; j < kColumns; ++j) {
        const int c = lane + kWarp * j;
        s.decay[i * stride + c] = c < dk ? expf(a.g[gate * dk + c]) : 0.0f;
      }
    }
    if (lane == 0) {
      if constexpr (!kPerKey) {
        s.decay[i] = expf(a.g[gate]);
      }
      s.beta[i] = a.beta[gate];
      s.active[i] = (a.mask == nullptr || a.mask[bt]) ? 1.0f : 0.0f;
    }
  }
  const T* v = static_cast<const T*>(a.v);
  const T* dy = static_cast<const T*>(o.dy);
  for (int x = threadIdx.x; x < length * kBlockRows; x += kBackwardThreads) {
    const int i = x / kBlockRows;
    const int r = first + x % kBlockRows;
    const int64_t at =
        ((int64_t(b) * a.tokens + start + i) * a.value_heads + h) * dv + r;
    s.v[x] = r < dv ? to_float(v[at]) : 0.0f;
    if (readout) {
      s.dy[x] = r < dv ? a.scale * to_float(dy[at]) : 0.0f;
    }
  }
}

// The warp's rows of a [Dv, Dk] state of the call (rows and columns past the
// dims are zero in registers, not read or written).
template <int kColumns>
__device__ __forceinline__ void load_state(
    const float* state,
    int row0,
    int dv,
    int dk,
    int lane,
    float (&s)[kRows][kColumns]) {
#pragma unroll
  for (int n = 0; n < kRows; ++n) {
    const int r = row0 + n;
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      const int c = lane + kWarp * j;
      s[n][j] = (r < dv && c < dk) ? state[int64_t(r) * dk + c] : 0.0f;
    }
  }
}

template <int kColumns>
__device__ __forceinline__ void store_state(
    float* state,
    int row0,
    int dv,
    int dk,
    int lane,
    const float (&s)[kRows][kColumns]) {
#pragma unroll
  for (int n = 0; n < kRows; ++n) {
    const int r = row0 + n;
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      const int c = lane + kWarp * j;
      if (r < dv && c < dk) {
        state[int64_t(r) * dk + c] = s[n][j];
      }
    }
  }
}

// The warp's rows in a block's tile of scratch ([kBlockRows, kColumns * 32],
// padding included, so no bounds).
template <int kColumns>
__device__ __forceinline__ void store_tile(
    float* tile, int row0, int lane, const float (&s)[kRows][kColumns]) {
#pragma unroll
  for (int n = 0; n < kRows; ++n) {
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      tile[(row0 + n) * kColumns * kWarp + lane + kWarp * j] = s[n][j];
    }
  }
}

template <int kColumns>
__device__ __forceinline__ void load_tile(
    const float* tile, int row0, int lane, float (&s)[kRows][kColumns]) {
#pragma unroll
  for (int n = 0; n < kRows; ++n) {
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      s[n][j] = tile[(row0 + n) * kColumns * kWarp + lane + kWarp * j];
    }
  }
}

// One staged token of the forward on the warp's rows (`row0` within the
// block); a masked token leaves them.
template <int kColumns, bool kPerKey>
__device__ __forceinline__ void forward_token(
    const Staged& staged,
    int i,
    int row0,
    int lane,
    float (&s)[kRows][kColumns]) {
  constexpr int stride = kColumns * kWarp;
  if (staged.active[i] == 0.0f) {
    return;
  }
  float k[kColumns], decay[kColumns];
#pragma unroll
  for (int j = 0; j < kColumns; ++j) {
    k[j] = staged.k[i * stride + lane + kWarp * j];
    decay[j] =
        kPerKey ? staged.decay[i * stride + lane + kWarp * j] : staged.decay[i];
  }
  const float beta = staged.beta[i];
#pragma unroll
  for (int n = 0; n < kRows; ++n) {
    float partial = 0.0f;
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      partial += (kPerKey ? decay[j] * s[n][j] : s[n][j]) * k[j];
    }
    const float predicted =
        kPerKey ? warp_sum(partial) : decay[0] * warp_sum(partial);
    const float delta =
        beta * (staged.v[i * kBlockRows + row0 + n] - predicted);
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      s[n][j] = decay[j] * s[n][j] + delta * k[j];
    }
  }
}

template <typename T, int kColumns, bool kPerKey>
__device__ __forceinline__ void recurrent_backward(
    const CoreArgs& a, const BackwardArgs& o) {
  extern __shared__ float shared[];
  constexpr int stride = kColumns * kWarp;
  const Staged staged = staged_layout<kColumns, kPerKey>(shared);

  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int kh = key_head_of(a, h);
  const int dk = a.key_dim, dv = a.value_dim;
  const int first = blockIdx.x * kBlockRows;  // the block's first row
  const int row0 = warp * kRows;  // the warp's first row within the block
  const int width = backward_partial_width(dk, kPerKey);
  const int gate_width = kPerKey ? dk : 1;
  const int64_t state_size = int64_t(dv) * dk;
  const int64_t head = int64_t(b) * a.value_heads + h;
  const int64_t block = head * gridDim.x + blockIdx.x;
  const int chunks = (a.tokens + kChunk - 1) / kChunk;
  constexpr int64_t tile = int64_t(kBlockRows) * stride;
  float* boundaries = o.boundaries + block * chunks * tile;
  float* before = o.chunk_states + block * kChunk * tile;

  // boundary_states (the last chunk's tokens are stepped again below).
  float s[kRows][kColumns];
  load_state(a.state_in + head * state_size, first + row0, dv, dk, lane, s);
  for (int c = 0; c < chunks; ++c) {
    store_tile(boundaries + c * tile, row0, lane, s);
    if (c + 1 < chunks) {
      __syncthreads();  // the previous chunk's staged inputs are read
      stage_chunk<T, kColumns, kPerKey>(
          a, o, staged, b, h, kh, first, c * kChunk, kChunk, false);
      __syncthreads();
      for (int i = 0; i < kChunk; ++i) {
        forward_token<kColumns, kPerKey>(staged, i, row0, lane, s);
      }
    }
  }

  float ds[kRows][kColumns];
  load_state(
      o.state_cotangent + head * state_size, first + row0, dv, dk, lane, ds);
  T* dv_all = static_cast<T*>(o.dv);
  int parity = 0;
  for (int c = chunks - 1; c >= 0; --c) {
    const int start = c * kChunk;
    const int length = min(kChunk, a.tokens - start);
    __syncthreads();
    stage_chunk<T, kColumns, kPerKey>(
        a, o, staged, b, h, kh, first, start, length, true);
    __syncthreads();
    // chunk_states
    load_tile(boundaries + c * tile, row0, lane, s);
    for (int i = 0; i < length; ++i) {
      store_tile(before + i * tile, row0, lane, s);
      forward_token<kColumns, kPerKey>(staged, i, row0, lane, s);
    }
    // recurrent_chunk_backward: s holds the state after token i, `next` the
    // state before it, read a token ahead.
    float next[kRows][kColumns];
    load_tile(before + (length - 1) * tile, row0, lane, next);
    for (int i = length - 1; i >= 0; --i) {
      float old[kRows][kColumns];
#pragma unroll
      for (int n = 0; n < kRows; ++n) {
#pragma unroll
        for (int j = 0; j < kColumns; ++j) {
          old[n][j] = next[n][j];
        }
      }
      if (i > 0) {
        load_tile(before + (i - 1) * tile, row0, lane, next);
      }
      const int64_t gate =
          (int64_t(b) * a.tokens + start + i) * a.value_heads + h;
      float q[kColumns], k[kColumns], decay[kColumns];
#pragma unroll
      for (int j = 0; j < kColumns; ++j) {
        q[j] = staged.q[i * stride + lane + kWarp * j];
        k[j] = staged.k[i * stride + lane + kWarp * j];
        decay[j] = kPerKey ? staged.decay[i * stride + lane + kWarp * j]
                           : staged.decay[i];
      }
      const float beta = staged.beta[i];
      // A skipped token: the state and dS pass through, its sums are zero.
      const bool active = staged.active[i] != 0.0f;
      float dq[kColumns] = {}, dk_sum[kColumns] = {}, da[kColumns] = {};
      float dbeta = 0.0f;
#pragma unroll
      for (int n = 0; n < kRows; ++n) {
        const int r = first + row0 + n;
        if (!active) {
          if (lane == 0 && r < dv) {
            dv_all[gate * dv + r] = from_float<T>(0.0f);
          }
          continue;
        }
        const float dy_scaled = staged.dy[i * kBlockRows + row0 + n];
        const float v_r = staged.v[i * kBlockRows + row0 + n];
        float dd_part = 0.0f, old_k_part = 0.0f;
#pragma unroll
        for (int j = 0; j < kColumns; ++j) {
          ds[n][j] += dy_scaled * q[j];
          dq[j] += dy_scaled * s[n][j];
          dd_part += ds[n][j] * k[j];
          old_k_part += (kPerKey ? decay[j] * old[n][j] : old[n][j]) * k[j];
        }
        const float dd = warp_sum(dd_part);
        const float predicted =
            kPerKey ? warp_sum(old_k_part) : decay[0] * warp_sum(old_k_part);
        const float residual = v_r - predicted;  // v - p
        const float delta = beta * residual;
        const float dp = -beta * dd;
        if (lane == 0 && r < dv) {
          dv_all[gate * dv + r] = from_float<T>(beta * dd);
        }
        dbeta += dd * residual;
#pragma unroll
        for (int j = 0; j < kColumns; ++j) {
          dk_sum[j] += delta * ds[n][j] + decay[j] * dp * old[n][j];
          const float dsd = ds[n][j] + dp * k[j];
          da[j] += dsd * old[n][j];
          ds[n][j] = decay[j] * dsd;
        }
      }
#pragma unroll
      for (int n = 0; n < kRows; ++n) {
#pragma unroll
        for (int j = 0; j < kColumns; ++j) {
          s[n][j] = old[n][j];  // the state before this token
        }
      }
      float* mine = staged.partials + (parity * kBackwardWarps + warp) * width;
#pragma unroll
      for (int j = 0; j < kColumns; ++j) {
        const int col = lane + kWarp * j;
        if (col < dk) {
          mine[col] = dq[j];
          mine[dk + col] = dk_sum[j];
          if constexpr (kPerKey) {
            mine[2 * dk + col] = da[j];
          }
        }
      }
      if constexpr (!kPerKey) {
        float da_lane = 0.0f;
#pragma unroll
        for (int j = 0; j < kColumns; ++j) {
          da_lane += da[j];
        }
        const float da_warp = warp_sum(da_lane);
        if (lane == 0) {
          mine[2 * dk] = da_warp;
        }
      }
      if (lane == 0) {
        mine[2 * dk + gate_width] = dbeta;
      }
      __syncthreads();
      const float* sums = staged.partials + parity * kBackwardWarps * width;
      float* out = o.partials + (gate * gridDim.x + blockIdx.x) * width;
      for (int x = threadIdx.x; x < width; x += kBackwardThreads) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < kBackwardWarps; ++w) {
          sum += sums[w * width + x];
        }
        out[x] = sum;
      }
#ifndef GD_SANITIZER_PROBE
      parity ^= 1;  // the probe reuses one buffer: a race racecheck reports
#endif
    }
  }
  store_state(o.dstate + head * state_size, first + row0, dv, dk, lane, ds);
}

// The sum of a head's row blocks' shares at `offset` of each token's partial
// sums (qk_grad_reduce below), in the blocks' order.
__device__ __forceinline__ float sum_row_blocks(
    const float* partials,
    int64_t gate,
    int row_blocks,
    int width,
    int offset) {
  const float* at = partials + gate * row_blocks * width + offset;
  float sum = 0.0f;
  for (int n = 0; n < row_blocks; ++n) {
    sum += at[n * width];
  }
  return sum;
}

// qk_grad_reduce for one (batch row, token, key head) per warp: the gradient
// of the normalised vector summed over its value heads (each the sum of its
// row blocks'), then through x / n, n = sqrt(x.x + eps): (c n^2 - x (x.c)) /
// n^3, the two dot products and the difference in float64 (they cancel along
// x).
template <typename T>
__device__ __forceinline__ void qk_grad_reduce(
    const CoreArgs& a,
    const float* partials,
    int row_blocks,
    int offset,
    const T* raw,
    T* out,
    int64_t row,
    int lane) {
  constexpr int kColumns = kBackwardMaxDim / kWarp;
  const int dk = a.key_dim;
  const int kh = int(row % a.key_heads);
  const int64_t bt = row / a.key_heads;
  const int ratio = a.value_heads / a.key_heads;
  const int width = backward_partial_width(dk, a.per_key_gates);
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
      sum[j] += sum_row_blocks(
          partials, bt * a.value_heads + head, row_blocks, width, offset + c);
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

// The gates' gradients of the value heads that read one (batch row, token,
// key head): da (dgamma), dg = a da (exactly 0 at a wipe, a = 0) and dbeta,
// each the sum of the head's row blocks'.
__device__ __forceinline__ void gate_grad_reduce(
    const CoreArgs& a, const BackwardArgs& o, int64_t row, int lane) {
  const int dk = a.key_dim;
  const int kh = int(row % a.key_heads);
  const int64_t bt = row / a.key_heads;
  const int ratio = a.value_heads / a.key_heads;
  const int row_blocks = o.partial_blocks;
  const int width = backward_partial_width(dk, a.per_key_gates);
  const int gate_width = a.per_key_gates ? dk : 1;
  // A skipped token's sums are zero; its dg is 0 whatever its g.
  const bool active = a.mask == nullptr || a.mask[bt];
  for (int n = 0; n < ratio; ++n) {
    const int head = a.grouped ? kh * ratio + n : kh + n * a.key_heads;
    const int64_t gate = bt * a.value_heads + head;
    for (int c = lane; c <= gate_width; c += kWarp) {
      const float sum =
          sum_row_blocks(o.partials, gate, row_blocks, width, 2 * dk + c);
      if (c == gate_width) {
        o.dbeta[gate] = sum;
      } else {
        const int64_t at = gate * gate_width + c;
        o.dgamma[at] = sum;
        o.dg[at] = active ? expf(a.g[at]) * sum : 0.0f;
      }
    }
  }
}

template <typename T>
__device__ __forceinline__ void qk_grad_reduce_rows(
    const CoreArgs& a, const BackwardArgs& o) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = int64_t(blockIdx.x) * kReduceWarps + threadIdx.x / kWarp;
  if (row >= int64_t(a.batch) * a.tokens * a.key_heads) {
    return;
  }
  qk_grad_reduce<T>(
      a,
      o.partials,
      o.partial_blocks,
      0,
      static_cast<const T*>(a.q),
      static_cast<T*>(o.dq),
      row,
      lane);
  qk_grad_reduce<T>(
      a,
      o.partials,
      o.partial_blocks,
      a.key_dim,
      static_cast<const T*>(a.k),
      static_cast<T*>(o.dk),
      row,
      lane);
  gate_grad_reduce(a, o, row, lane);
}

}  // namespace

}  // namespace mlx_gated_delta::cuda

// The entry points the executor looks up by name (launch_shapes.h):
// gd_recurrent_backward_<dtype>_c<columns>[_per_key] and
// gd_qk_grad_reduce_<dtype>. One block a multiprocessor is asked of
// recurrent_backward, which leaves it the registers for its rows of S, dS and
// the two states read back without spilling (at Dk = 128 it needs about 165;
// held to 128, two blocks a multiprocessor, it spilled 96 bytes a thread).
#define GD_BACKWARD_ENTRY(type, suffix, columns, per_key, name)              \
  extern "C" __global__ void __launch_bounds__(                              \
      mlx_gated_delta::cuda::kBackwardThreads, 1)                            \
      gd_recurrent_backward_##suffix##_c##columns##name(                     \
          const mlx_gated_delta::cuda::CoreArgs a,                           \
          const mlx_gated_delta::cuda::BackwardArgs o) {                     \
    mlx_gated_delta::cuda::recurrent_backward<type, columns, per_key>(a, o); \
  }
// Columns 1 to 7 (key dims up to 224) for both gate kinds, 8 (up to 256) for
// scalar gates only: backward_max_key_dim(true) is 224.
#define GD_BACKWARD_COLUMNS(type, suffix, per_key, name) \
  GD_BACKWARD_ENTRY(type, suffix, 1, per_key, name)      \
  GD_BACKWARD_ENTRY(type, suffix, 2, per_key, name)      \
  GD_BACKWARD_ENTRY(type, suffix, 3, per_key, name)      \
  GD_BACKWARD_ENTRY(type, suffix, 4, per_key, name)      \
  GD_BACKWARD_ENTRY(type, suffix, 5, per_key, name)      \
  GD_BACKWARD_ENTRY(type, suffix, 6, per_key, name)      \
  GD_BACKWARD_ENTRY(type, suffix, 7, per_key, name)
#define GD_BACKWARD_ENTRIES(type, suffix)                   \
  GD_BACKWARD_COLUMNS(type, suffix, false, )                \
  GD_BACKWARD_ENTRY(type, suffix, 8, false, )               \
  GD_BACKWARD_COLUMNS(type, suffix, true, _per_key)         \
  extern "C" __global__ void __launch_bounds__(             \
      32 * mlx_gated_delta::cuda::kReduceWarps)             \
      gd_qk_grad_reduce_##suffix(                           \
          const mlx_gated_delta::cuda::CoreArgs a,          \
          const mlx_gated_delta::cuda::BackwardArgs o) {    \
    mlx_gated_delta::cuda::qk_grad_reduce_rows<type>(a, o); \
  }
GD_BACKWARD_ENTRIES(float, f32)
GD_BACKWARD_ENTRIES(__half, f16)
GD_BACKWARD_ENTRIES(__nv_bfloat16, bf16)
