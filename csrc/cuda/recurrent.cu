// The recurrent form on CUDA (stage `recurrent`, docs/stages.md): token by
// token, with the state in registers for the whole call.
//
// One block per (row block, value head, batch row); each warp owns kRows
// rows of the state [Dv, Dk] (launch_shapes.h), each lane kColumns =
// ceil(Dk / 32) columns of each row, in runs of kVector adjacent columns, so
// that the state moves in 16-byte loads and stores where Dk allows. Per token
// a warp reads q, k (and L2-normalises them), then for all its rows at once:
// the predictions S k, the delta update, the readouts S q. The sums over a
// row's lanes are reduced for the warp's rows together (warp_sum_rows), which
// leaves row i's sums in lanes [i kLanesPerRow, (i + 1) kLanesPerRow): those
// lanes read the row's v and write its y. The next token's q, k, v and gates
// are loaded while the current token is computed. The state is read once at
// the start and written once at the end, so a decode step moves it exactly
// once; the warps of a head never talk to each other.
// With a tree (parents), each token starts from its parent's state, which the
// same lanes wrote to tree_states when they stepped the parent.
#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/launch_shapes.h"

namespace mlx_gated_delta::cuda {

namespace {

template <int kColumns>
struct LaneColumns {
  static constexpr int kVector =
      kColumns % 4 == 0 ? 4 : (kColumns % 2 == 0 ? 2 : 1);
  static constexpr int kRows = recurrent_rows_per_warp(kColumns);
  static constexpr int kLanesPerRow = kWarp / kRows;

  // The column of a lane's j-th value: runs of kVector columns, the warp's
  // lanes side by side.
  __device__ static int column(int lane, int j) {
    return j / kVector * kWarp * kVector + lane * kVector + j % kVector;
  }
};

// kVector floats at `p` into x: one load (p 4 kVector-byte aligned) where
// `vector` and the run is whole, else the first `valid` floats, 0 after.
template <int kVector>
__device__ __forceinline__ void load_run(
    const float* p, bool vector, int valid, float* x) {
  if (vector && valid >= kVector) {
    if constexpr (kVector == 4) {
      const float4 f = *reinterpret_cast<const float4*>(p);
      x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
    } else if constexpr (kVector == 2) {
      const float2 f = *reinterpret_cast<const float2*>(p);
      x[0] = f.x, x[1] = f.y;
    } else {
      x[0] = *p;
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < kVector; ++e) {
    x[e] = e < valid ? p[e] : 0.0f;
  }
}

template <int kVector>
__device__ __forceinline__ void store_run(
    float* p, bool vector, int valid, const float* x) {
  if (vector && valid >= kVector) {
    if constexpr (kVector == 4) {
      *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
    } else if constexpr (kVector == 2) {
      *reinterpret_cast<float2*>(p) = make_float2(x[0], x[1]);
    } else {
      *p = x[0];
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < kVector; ++e) {
    if (e < valid) {
      p[e] = x[e];
    }
  }
}

// One token's inputs as a warp reads them: q and k in the lane's columns (0
// past Dk), the per-key gates likewise (or the scalar gate in gate[0]), v of
// the row whose sums the lane ends with (0 past Dv), beta, and whether the
// token is active.
template <typename T, int kColumns>
struct TokenInputs {
  float q[kColumns], k[kColumns], gate[kColumns];
  float v, beta;
  bool active;

  __device__ void fetch(
      const CoreArgs& a, int b, int t, int h, int kh, int lane, int sum_row) {
    using Lanes = LaneColumns<kColumns>;
    const int dk = a.key_dim;
    const int64_t bt = int64_t(b) * a.tokens + t;
    active = a.mask == nullptr || a.mask[bt];
    const int64_t qk_row = (bt * a.key_heads + kh) * dk;
    const int64_t gate_index = bt * a.value_heads + h;
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      const int c = Lanes::column(lane, j);
      q[j] = c < dk ? to_float(static_cast<const T*>(a.q)[qk_row + c]) : 0.0f;
      k[j] = c < dk ? to_float(static_cast<const T*>(a.k)[qk_row + c]) : 0.0f;
      gate[j] = a.per_key_gates && c < dk ? a.g[gate_index * dk + c] : 0.0f;
    }
    if (!a.per_key_gates) {
      gate[0] = a.g[gate_index];
    }
    beta = a.beta[gate_index];
    v = sum_row < a.value_dim ? to_float(static_cast<const T*>(
                                    a.v)[gate_index * a.value_dim + sum_row])
                              : 0.0f;
  }
};

template <typename T, int kColumns>
__device__ __forceinline__ void recurrent(const CoreArgs& a) {
  using Lanes = LaneColumns<kColumns>;
  constexpr int kRows = Lanes::kRows, kVector = Lanes::kVector;
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int kh = key_head_of(a, h);
  const int dk = a.key_dim, dv = a.value_dim;
  const int row0 = (blockIdx.x * kRecurrentWarps + warp) * kRows;
  // The row whose sums this lane holds after warp_sum_rows; the first lane of
  // each row writes its y.
  const int sum_row = row0 + lane / Lanes::kLanesPerRow;
  const bool writes_y = lane % Lanes::kLanesPerRow == 0 && sum_row < dv;
  const int64_t state_size = int64_t(dv) * dk;
  const int64_t head_state = (int64_t(b) * a.value_heads + h) * state_size;

  float s[kRows][kColumns];
  // Rows past Dv and columns past Dk are 0 and never stored.
  auto load_state = [&](const float* state) {
    const bool vector = dk % kVector == 0 &&
        reinterpret_cast<uintptr_t>(state) % (4 * kVector) == 0;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = row0 + i;
#pragma unroll
      for (int j = 0; j < kColumns; j += kVector) {
        const int c = Lanes::column(lane, j);
        load_run<kVector>(
            state + int64_t(r) * dk + c, vector, r < dv ? dk - c : 0, &s[i][j]);
      }
    }
  };
  auto store_state = [&](float* state) {
    const bool vector = dk % kVector == 0 &&
        reinterpret_cast<uintptr_t>(state) % (4 * kVector) == 0;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = row0 + i;
#pragma unroll
      for (int j = 0; j < kColumns; j += kVector) {
        const int c = Lanes::column(lane, j);
        store_run<kVector>(
            state + int64_t(r) * dk + c, vector, r < dv ? dk - c : 0, &s[i][j]);
      }
    }
  };
  load_state(a.state_in + head_state);
  float* tree = a.parents
      ? a.tree_states + (int64_t(b) * a.value_heads + h) * a.tokens * state_size
      : nullptr;

  T* y_all = static_cast<T*>(a.y);
  int next_checkpoint = 0;
  TokenInputs<T, kColumns> next;
  if (a.tokens > 0) {
    next.fetch(a, b, 0, h, kh, lane, sum_row);
  }
  for (int t = 0; t < a.tokens; ++t) {
    const TokenInputs<T, kColumns> in = next;
    if (t + 1 < a.tokens) {
      next.fetch(a, b, t + 1, h, kh, lane, sum_row);
    }
    const int64_t y_row =
        ((int64_t(b) * a.tokens + t) * a.value_heads + h) * dv;
    if (tree) {
      const int parent = a.parents[t];
      load_state(
          parent < 0 ? a.state_in + head_state : tree + parent * state_size);
    }
    float y = 0.0f;
    if (in.active) {
      float q[kColumns], k[kColumns];
      float q_squares = 0.0f, k_squares = 0.0f;
#pragma unroll
      for (int j = 0; j < kColumns; ++j) {
        q[j] = in.q[j];
        k[j] = in.k[j];
        q_squares += q[j] * q[j];
        k_squares += k[j] * k[j];
      }
      if (a.normalize_qk) {
        const float q_scale = inverse_norm(warp_sum(q_squares));
        const float k_scale = inverse_norm(warp_sum(k_squares));
#pragma unroll
        for (int j = 0; j < kColumns; ++j) {
          q[j] *= q_scale;
          k[j] *= k_scale;
        }
      }
      // Scalar gates: the prediction is decay (S k), as on the CPU; per-key
      // gates: the decayed state's S (decay . k), g = -inf a wipe (0).
      float decay[kColumns];
      const float scalar_decay = a.per_key_gates ? 1.0f : expf(in.gate[0]);
#pragma unroll
      for (int j = 0; j < kColumns; ++j) {
        decay[j] = a.per_key_gates
            ? (Lanes::column(lane, j) < dk ? expf(in.gate[j]) : 0.0f)
            : scalar_decay;
      }
      float sums[kRows];
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        sums[i] = 0.0f;
#pragma unroll
        for (int j = 0; j < kColumns; ++j) {
          sums[i] += s[i][j] * (a.per_key_gates ? decay[j] * k[j] : k[j]);
        }
      }
      const float predicted = scalar_decay * warp_sum_rows(sums);
      const float delta = in.beta * (in.v - predicted);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const float row_delta =
            __shfl_sync(0xffffffffu, delta, i * Lanes::kLanesPerRow);
        sums[i] = 0.0f;
#pragma unroll
        for (int j = 0; j < kColumns; ++j) {
          s[i][j] = decay[j] * s[i][j] + row_delta * k[j];
          sums[i] += s[i][j] * q[j];
        }
      }
      y = a.scale * warp_sum_rows(sums);
    }
    if (writes_y) {
      y_all[y_row + sum_row] = from_float<T>(y);
    }
    if (tree) {
      store_state(tree + t * state_size);
    }
    // A checkpoint is a copy of the state after its token, masked or not.
    if (next_checkpoint < a.checkpoint_count &&
        a.checkpoints[next_checkpoint] == t + 1) {
      store_state(
          a.checkpoint_states +
          int64_t(next_checkpoint) * a.batch * a.value_heads * state_size +
          head_state);
      ++next_checkpoint;
    }
  }
  // With a tree too, the final state is the last token's.
  store_state(a.state_out + head_state);
}

}  // namespace

}  // namespace mlx_gated_delta::cuda

// The entry points the executor looks up by name (launch_shapes.h):
// gd_recurrent_<dtype>_c<columns>.
#define GD_RECURRENT_ENTRY(type, suffix, columns)       \
  extern "C" __global__ void __launch_bounds__(         \
      mlx_gated_delta::cuda::kRecurrentThreads)         \
      gd_recurrent_##suffix##_c##columns(               \
          const mlx_gated_delta::cuda::CoreArgs a) {    \
    mlx_gated_delta::cuda::recurrent<type, columns>(a); \
  }
#define GD_RECURRENT_ENTRIES(columns)      \
  GD_RECURRENT_ENTRY(float, f32, columns)  \
  GD_RECURRENT_ENTRY(__half, f16, columns) \
  GD_RECURRENT_ENTRY(__nv_bfloat16, bf16, columns)
GD_RECURRENT_ENTRIES(1)
GD_RECURRENT_ENTRIES(2)
GD_RECURRENT_ENTRIES(3)
GD_RECURRENT_ENTRIES(4)
GD_RECURRENT_ENTRIES(5)
GD_RECURRENT_ENTRIES(6)
GD_RECURRENT_ENTRIES(7)
GD_RECURRENT_ENTRIES(8)
