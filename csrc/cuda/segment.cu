// The fused layer segment's own stages on CUDA (docs/stages.md, "Forward:
// the fused layer segment"), each a kernel of the stage's name, launched by
// the executor around the core's kernels (recurrent or chunked) on float32
// buffers between them:
//
//   prepare_conv        the causal depthwise conv over q|k|v with the carried
//                       conv state, then SiLU, into float32 q, k and v;
//   prepare_gates       g and beta from the packed a and b columns;
//   collect_conv_state  the new conv state, and with checkpoints the conv
//                       state after each one (collect_conv_checkpoints);
//   gated_norm          rms_norm(y) norm_weight silu(z) (or sigmoid(z)) from
//                       the core's float32 y, 0 on masked tokens.
//
// The math is the CPU's (csrc/cpu/segment.cpp, segment_common.h), float32
// whatever the activation dtype; the conv sums its taps oldest first, as the
// CPU does. Skip semantics of the mask: a masked token is in no conv window,
// its q, k, v and out rows are 0, and the conv states hold the last K - 1
// kept inputs. None of these stages uses shared memory; each thread writes
// its own outputs.
#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/launch_shapes.h"

namespace mlx_gated_delta::cuda {

namespace {

__device__ inline float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

__device__ inline float silu(float x) {
  return x * sigmoid(x);
}

// log(1 + exp(x)) without overflow for large x and without losing the small
// tail for very negative x (as the CPU's).
__device__ inline float softplus(float x) {
  return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
}

__device__ inline bool is_kept(const SegmentArgs& a, int b, int t) {
  return a.mask == nullptr || a.mask[int64_t(b) * a.tokens + t];
}

// The rows a batch row's conv sees, indexed as the extended sequence
// [conv state; tokens]: row e < K - 1 is conv state row e, row e >= K - 1
// is token e - (K - 1). Conv state rows are always kept; a masked token's
// row is skipped.
struct ConvRows {
  const SegmentArgs& a;
  int b;

  __device__ bool kept(int e) const {
    return e < a.conv_kernel - 1 || is_kept(a, b, e - (a.conv_kernel - 1));
  }
  // The kept row before e (e itself kept or not); -1 when there is none.
  __device__ int previous(int e) const {
    do {
      --e;
    } while (e >= 0 && !kept(e));
    return e;
  }
  __device__ int next(int e) const {
    do {
      ++e;
    } while (!kept(e));
    return e;
  }
  // Channel c of row e.
  template <typename T>
  __device__ float value(int e, int c) const {
    const int history = a.conv_kernel - 1;
    if (e < history) {
      return to_float(static_cast<const T*>(
          a.conv_state_in)[(int64_t(b) * history + e) * a.conv_channels + c]);
    }
    return to_float(static_cast<const T*>(
        a.mixed)[(int64_t(b) * a.tokens + e - history) * a.mixed_width + c]);
  }
};

// One thread per (channel, token, batch row): blocks of kSegmentThreads
// channels of one token, the tokens of all rows one after another.
template <typename T>
__device__ void prepare_conv(const SegmentArgs& a) {
  const int channel_blocks =
      (a.conv_channels + kSegmentThreads - 1) / kSegmentThreads;
  const int64_t row = blockIdx.x / channel_blocks;  // b * T + t
  const int c =
      int(blockIdx.x % channel_blocks) * kSegmentThreads + int(threadIdx.x);
  if (c >= a.conv_channels) {
    return;
  }
  const int b = int(row / a.tokens);
  const int t = int(row % a.tokens);
  float sum = 0.0f;
  if (is_kept(a, b, t)) {
    const ConvRows rows{a, b};
    // The window: this token and the K - 1 kept rows before it.
    int e = t + a.conv_kernel - 1;
    for (int tap = 1; tap < a.conv_kernel; ++tap) {
      e = rows.previous(e);
    }
    const float* weight = a.conv_weight + int64_t(c) * a.conv_kernel;
    for (int tap = 0; tap < a.conv_kernel; ++tap) {
      sum += rows.value<T>(e, c) * weight[tap];
      if (tap + 1 < a.conv_kernel) {
        e = rows.next(e);
      }
    }
    sum = silu(sum);
  }
  const int qk_width = a.key_heads * a.key_dim;
  if (c < qk_width) {
    a.q[row * qk_width + c] = sum;
  } else if (c < 2 * qk_width) {
    a.k[row * qk_width + c - qk_width] = sum;
  } else {
    a.v[row * (int64_t(a.value_heads) * a.value_dim) + c - 2 * qk_width] = sum;
  }
}

// One thread per value of g [B, T, Hv, gate_width]; the first of each value
// head's also writes its beta. Masked tokens get gates too: the core turns
// them into no-ops.
template <typename T>
__device__ void prepare_gates(const SegmentArgs& a) {
  const int per_row = a.value_heads * a.gate_width;
  const int64_t index = int64_t(blockIdx.x) * kSegmentThreads + threadIdx.x;
  if (index >= int64_t(a.batch) * a.tokens * per_row) {
    return;
  }
  const int64_t row = index / per_row;  // b * T + t
  const int column = int(index % per_row);  // h * gate_width + channel
  const int h = column / a.gate_width;
  const T* packed = static_cast<const T*>(a.mixed) + row * a.mixed_width;
  const float parameter = a.decay_parameter[h];
  const float rate = a.log_rate ? -expf(parameter) : parameter;
  const float u = to_float(packed[a.a_offset + column]) + a.dt_bias[column];
  a.g[index] = a.has_lower_bound ? a.lower_bound * sigmoid(-rate * u)
                                 : rate * softplus(u);
  if (column % a.gate_width == 0) {
    a.beta[row * a.value_heads + h] =
        a.beta_scale * sigmoid(to_float(packed[a.b_offset + h]));
  }
}

// One thread per (channel, conv state row, target): targets [0, B) are the
// new conv state of batch row b, after all the call's tokens; targets
// B (n + 1) + b the conv state of row b after checkpoints[n] tokens. Row r
// of a conv state after `tokens` tokens is the (K - 1 - r)-th newest kept
// input among the carried rows and those tokens: an exact copy.
template <typename T>
__device__ void collect_conv_state(const SegmentArgs& a) {
  const int history = a.conv_kernel - 1;
  const int channel_blocks =
      (a.conv_channels + kSegmentThreads - 1) / kSegmentThreads;
  const int64_t position = blockIdx.x / channel_blocks;
  const int c =
      int(blockIdx.x % channel_blocks) * kSegmentThreads + int(threadIdx.x);
  if (c >= a.conv_channels) {
    return;
  }
  const int r = int(position % history);
  const int target = int(position / history);
  const int b = target % a.batch;
  const int n = target / a.batch - 1;  // -1: the final conv state
  const int tokens = n < 0 ? a.tokens : a.checkpoints[n];
  const ConvRows rows{a, b};
  int e = tokens + history;  // one past the newest row
  for (int newer = 0; newer < history - r; ++newer) {
    e = rows.previous(e);
  }
  T* destination =
      static_cast<T*>(n < 0 ? a.conv_state_out : a.conv_checkpoint_states);
  const int64_t slot = int64_t(n < 0 ? b : target - a.batch);
  const T* source = e < history ? static_cast<const T*>(a.conv_state_in) +
          (int64_t(b) * history + e) * a.conv_channels
                                : static_cast<const T*>(a.mixed) +
          (int64_t(b) * a.tokens + e - history) * a.mixed_width;
  destination[(slot * history + r) * a.conv_channels + c] = source[c];
}

// One warp per (batch row, token, value head) row of y.
template <typename T>
__device__ void gated_norm(const SegmentArgs& a) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row =
      int64_t(blockIdx.x) * kGatedNormWarps + threadIdx.x / kWarp;
  // Both exits are uniform across the warp.
  if (row >= int64_t(a.batch) * a.tokens * a.value_heads) {
    return;
  }
  const int64_t token_row = row / a.value_heads;  // b * T + t
  const int h = int(row % a.value_heads);
  const int dv = a.value_dim;
  T* destination = static_cast<T*>(a.out) + row * dv;
  if (a.mask != nullptr && !a.mask[token_row]) {
    for (int d = lane; d < dv; d += kWarp) {
      destination[d] = from_float<T>(0.0f);
    }
    return;
  }
  const float* y = a.y + row * dv;
  float squares = 0.0f;
  for (int d = lane; d < dv; d += kWarp) {
    squares += y[d] * y[d];
  }
  const float inverse_rms =
      1.0f / sqrtf(warp_sum(squares) / float(dv) + a.norm_eps);
  const T* z = static_cast<const T*>(a.mixed) + token_row * a.mixed_width +
      a.z_offset + int64_t(h) * dv;
  for (int d = lane; d < dv; d += kWarp) {
    const float gate_input = to_float(z[d]);
    const float gate =
        a.sigmoid_output_gate ? sigmoid(gate_input) : silu(gate_input);
    destination[d] =
        from_float<T>(y[d] * inverse_rms * a.norm_weight[d] * gate);
  }
}

}  // namespace

}  // namespace mlx_gated_delta::cuda

// The entry points the executor looks up by name:
// gd_segment_<stage>_<dtype>.
#define GD_SEGMENT_ENTRY(stage, threads, type, suffix)  \
  extern "C" __global__ void __launch_bounds__(threads) \
      gd_segment_##stage##_##suffix(                    \
          const mlx_gated_delta::cuda::SegmentArgs a) { \
    mlx_gated_delta::cuda::stage<type>(a);              \
  }
#define GD_SEGMENT_ENTRIES(stage, threads)      \
  GD_SEGMENT_ENTRY(stage, threads, float, f32)  \
  GD_SEGMENT_ENTRY(stage, threads, __half, f16) \
  GD_SEGMENT_ENTRY(stage, threads, __nv_bfloat16, bf16)
GD_SEGMENT_ENTRIES(prepare_conv, mlx_gated_delta::cuda::kSegmentThreads)
GD_SEGMENT_ENTRIES(prepare_gates, mlx_gated_delta::cuda::kSegmentThreads)
GD_SEGMENT_ENTRIES(collect_conv_state, mlx_gated_delta::cuda::kSegmentThreads)
GD_SEGMENT_ENTRIES(gated_norm, 32 * mlx_gated_delta::cuda::kGatedNormWarps)
