// The recurrent form on CUDA (stage `recurrent`, docs/stages.md): token by
// token, with the state in registers for the whole call.
//
// One block per (row block, value head, batch row); each warp owns
// kRowsPerWarp rows of the state [Dv, Dk], each lane the columns
// c = lane + 32 j of those rows (kColumns = ceil(Dk / 32) of them). Per token
// a warp reads q, k (and L2-normalises them), then per row: the prediction
// S k (a warp sum), the delta update, the readout S q (a warp sum). The state
// is read once at the start and written once at the end, so a decode step
// moves it exactly once; the warps of a head never talk to each other.
// With a tree (parents), each token starts from its parent's state, which the
// same lanes wrote to tree_states when they stepped the parent.
#include "cuda/device_common.cuh"
#include "cuda/launch_shapes.h"

namespace mlx_gated_delta::cuda {

namespace {

template <typename T, int kColumns>
__device__ __forceinline__ void recurrent(const CoreArgs& a) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int kh = key_head_of(a, h);
  const int dk = a.key_dim, dv = a.value_dim;
  const int row0 = blockIdx.x * kRecurrentRowsPerBlock + warp * kRowsPerWarp;
  const int64_t head_state = (int64_t(b) * a.value_heads + h) * dv * dk;

  float s[kRowsPerWarp][kColumns];
  auto load_state = [&](const float* state) {
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = row0 + i;
#pragma unroll
      for (int j = 0; j < kColumns; ++j) {
        const int c = lane + kWarp * j;
        s[i][j] = (r < dv && c < dk) ? state[int64_t(r) * dk + c] : 0.0f;
      }
    }
  };
  auto store_state = [&](float* state) {
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = row0 + i;
#pragma unroll
      for (int j = 0; j < kColumns; ++j) {
        const int c = lane + kWarp * j;
        if (r < dv && c < dk) {
          state[int64_t(r) * dk + c] = s[i][j];
        }
      }
    }
  };
  load_state(a.state_in + head_state);
  const int64_t state_size = int64_t(dv) * dk;
  float* tree = a.parents
      ? a.tree_states + (int64_t(b) * a.value_heads + h) * a.tokens * state_size
      : nullptr;

  const T* q_all = static_cast<const T*>(a.q);
  const T* k_all = static_cast<const T*>(a.k);
  const T* v_all = static_cast<const T*>(a.v);
  T* y_all = static_cast<T*>(a.y);
  int next_checkpoint = 0;
  for (int t = 0; t < a.tokens; ++t) {
    const int64_t bt = int64_t(b) * a.tokens + t;
    const bool active = a.mask == nullptr || a.mask[bt];
    const int64_t y_row = (bt * a.value_heads + h) * dv;
    if (tree) {
      const int parent = a.parents[t];
      load_state(
          parent < 0 ? a.state_in + head_state : tree + parent * state_size);
    }
    if (active) {
      const int64_t qk_row = (bt * a.key_heads + kh) * dk;
      float q[kColumns], k[kColumns], decay[kColumns];
      float q_squares = 0.0f, k_squares = 0.0f;
#pragma unroll
      for (int j = 0; j < kColumns; ++j) {
        const int c = lane + kWarp * j;
        q[j] = c < dk ? to_float(q_all[qk_row + c]) : 0.0f;
        k[j] = c < dk ? to_float(k_all[qk_row + c]) : 0.0f;
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
      const int64_t gate = bt * a.value_heads + h;
      const float beta = a.beta[gate];
      // Scalar gates: the prediction is decay (S k), as on the CPU; per-key
      // gates: the decayed state's S (decay . k), g = -inf a wipe (0).
      float scalar_decay = 1.0f;
      if (a.per_key_gates) {
#pragma unroll
        for (int j = 0; j < kColumns; ++j) {
          const int c = lane + kWarp * j;
          decay[j] = c < dk ? expf(a.g[gate * dk + c]) : 0.0f;
        }
      } else {
        scalar_decay = expf(a.g[gate]);
#pragma unroll
        for (int j = 0; j < kColumns; ++j) {
          decay[j] = scalar_decay;
        }
      }
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int r = row0 + i;
        float partial = 0.0f;
#pragma unroll
        for (int j = 0; j < kColumns; ++j) {
          partial += s[i][j] * (a.per_key_gates ? decay[j] * k[j] : k[j]);
        }
        float predicted = warp_sum(partial);
        if (!a.per_key_gates) {
          predicted *= scalar_decay;
        }
        const float v =
            r < dv ? to_float(v_all[(bt * a.value_heads + h) * dv + r]) : 0.0f;
        const float delta = beta * (v - predicted);
        float readout = 0.0f;
#pragma unroll
        for (int j = 0; j < kColumns; ++j) {
          s[i][j] = decay[j] * s[i][j] + delta * k[j];
          readout += s[i][j] * q[j];
        }
        readout = warp_sum(readout);
        if (lane == 0 && r < dv) {
          y_all[y_row + r] = from_float<T>(a.scale * readout);
        }
      }
    } else if (lane == 0) {
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        if (row0 + i < dv) {
          y_all[y_row + row0 + i] = from_float<T>(0.0f);
        }
      }
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
