// What the segment's forward stages (segment.cpp) and their backward
// (segment_backward.cpp) share: the elementwise functions, and how the causal
// depthwise conv walks a batch row's history, split into blocks of channels.
// In the namespace of the kernels' compiled level (kernel_level.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "segment/segment_params.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

inline float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}

inline float silu(float x) {
  return x * sigmoid(x);
}

// log(1 + exp(x)) without overflow for large x and without losing the small
// tail for very negative x.
inline float softplus(float x) {
  return std::fmax(x, 0.0f) + std::log1p(std::exp(-std::fabs(x)));
}

inline bool is_kept(const bool* mask, int64_t index) {
  return mask == nullptr || mask[index];
}

// The decay's rate from its parameter: -exp(A_log), or the rate itself.
inline float rate_of(const SegmentParams& p, float decay_parameter) {
  return p.decay_parameterization == DecayParameterization::LogRate
      ? -std::exp(decay_parameter)
      : decay_parameter;
}

// The log decay g of a token from its head's rate and u = a + dt_bias:
// rate * softplus(u), or lower_bound * sigmoid(-rate * u) with a lower bound.
inline float log_decay(const SegmentParams& p, float rate, float u) {
  return p.gates.has_lower_bound ? p.gates.lower_bound * sigmoid(-rate * u)
                                 : rate * softplus(u);
}

// d g / d u and d g / d rate of log_decay.
struct LogDecayPartials {
  float d_u;
  float d_rate;
};

inline LogDecayPartials log_decay_partials(
    const SegmentParams& p, float rate, float u) {
  if (p.gates.has_lower_bound) {
    const float s = sigmoid(-rate * u);
    const float scaled = p.gates.lower_bound * s * (1.0f - s);
    return {-rate * scaled, -u * scaled};
  }
  return {rate * sigmoid(u), softplus(u)};
}

// beta = sigmoid(b), in [0, 2] with allow_neg_eigval, and d beta / d b.
inline float beta_of(const SegmentParams& p, float b) {
  return (p.gates.allow_neg_eigval ? 2.0f : 1.0f) * sigmoid(b);
}

inline float beta_derivative(const SegmentParams& p, float b) {
  const float s = sigmoid(b);
  return (p.gates.allow_neg_eigval ? 2.0f : 1.0f) * s * (1.0f - s);
}

// What multiplies the normed output: silu(z) or sigmoid(z) (OutputGate),
// and its derivative.
inline float output_gate(const SegmentParams& p, float z) {
  return p.gates.output_gate == OutputGate::Sigmoid ? sigmoid(z) : silu(z);
}

inline float output_gate_derivative(const SegmentParams& p, float z) {
  const float s = sigmoid(z);
  return p.gates.output_gate == OutputGate::Sigmoid
      ? s * (1.0f - s)
      : s * (1.0f + z * (1.0f - s));
}

// The pre-conv rows one batch row's convolution sees, oldest first: the K-1
// rows of the carried conv state, then every unmasked token's packed row (its
// first C columns are q|k|v), as pointers into the caller's buffers; and the
// token of each unmasked rank.
template <typename T>
struct ConvHistory {
  std::vector<const T*> rows;
  std::vector<int> token_of_rank;
};

template <typename T>
std::vector<ConvHistory<T>> conv_histories(
    const SegmentParams& p,
    const T* mixed,
    const T* conv_state,
    const bool* mask) {
  const int C = p.conv_channels();
  std::vector<ConvHistory<T>> histories(p.batch);
  for (int b = 0; b < p.batch; ++b) {
    ConvHistory<T>& h = histories[b];
    h.rows.reserve(p.conv_state_rows() + p.tokens);
    for (int i = 0; i < p.conv_state_rows(); ++i) {
      h.rows.push_back(conv_state + (int64_t(b) * p.conv_state_rows() + i) * C);
    }
    for (int t = 0; t < p.tokens; ++t) {
      const int64_t index = int64_t(b) * p.tokens + t;
      if (is_kept(mask, index)) {
        h.rows.push_back(mixed + index * p.mixed_qkvzba_width());
        h.token_of_rank.push_back(t);
      }
    }
  }
  return histories;
}

// The conv runs in blocks of channels, one block per task: the depthwise
// conv has no dependency across channels, so every output element has one
// writer, and a call of one batch row still spreads over the threads.
constexpr int kChannelBlock = 64;

// A block of at most kChannelBlock conv channels [first, first + width),
// columns [column, column + width) of the buffer that holds its part of q, k
// and v.
struct ChannelBlock {
  int first;
  int width;
  int part;  // 0, 1, 2: q, k, v
  int column;
};

// The blocks of the channels of key heads [first_key_head, first_key_head +
// key_heads) and of the value heads that read them (consecutive ones: the
// grouped head mapping, or every key head), each block's `column` counted
// from the first of those channels in its part.
inline std::vector<ChannelBlock> channel_blocks(
    const SegmentParams& p, int first_key_head, int key_heads) {
  const int ratio = p.value_heads / p.key_heads;
  const int starts[3] = {
      first_key_head * p.key_dim,
      first_key_head * p.key_dim,
      first_key_head * ratio * p.value_dim};
  const int widths[3] = {
      key_heads * p.key_dim,
      key_heads * p.key_dim,
      key_heads * ratio * p.value_dim};
  const int part_firsts[3] = {0, p.qk_width(), 2 * p.qk_width()};
  std::vector<ChannelBlock> blocks;
  for (int part = 0; part < 3; ++part) {
    for (int column = 0; column < widths[part]; column += kChannelBlock) {
      const int width = std::min(kChannelBlock, widths[part] - column);
      blocks.push_back(
          {part_firsts[part] + starts[part] + column, width, part, column});
    }
  }
  return blocks;
}

// Every channel's blocks.
inline std::vector<ChannelBlock> channel_blocks(const SegmentParams& p) {
  return channel_blocks(p, 0, p.key_heads);
}

// Copies the [Dv, Dk] states of the value heads [first_head, first_head +
// heads) between `rows` rows of every head's states ([rows, Hv, Dv, Dk]: the
// batch rows, or checkpoints times batch rows) and of a wave's ([rows, heads,
// Dv, Dk]), into the wave's or out of it.
inline void copy_wave_states(
    const SegmentParams& p,
    int rows,
    int first_head,
    int heads,
    const float* from,
    float* to,
    bool into_wave) {
  const int64_t size = int64_t(p.value_dim) * p.key_dim;
  for (int b = 0; b < rows; ++b) {
    const int64_t all = (int64_t(b) * p.value_heads + first_head) * size;
    const int64_t wave = int64_t(b) * heads * size;
    const float* src = from + (into_wave ? all : wave);
    std::copy(src, src + heads * size, to + (into_wave ? wave : all));
  }
}

// The [C, K] conv weight tap-major ([K, C]), so that the channel loops read
// every operand with unit stride and vectorise.
inline std::vector<float> weight_by_tap(
    const SegmentParams& p, const float* weight) {
  const int C = p.conv_channels(), K = p.conv_kernel;
  std::vector<float> by_tap(int64_t(K) * C);
  for (int c = 0; c < C; ++c) {
    for (int i = 0; i < K; ++i) {
      by_tap[int64_t(i) * C + c] = weight[int64_t(c) * K + i];
    }
  }
  return by_tap;
}

// The conv output before SiLU of the unmasked token of rank r (its window is
// rows r .. r+K-1), for the block's channels, the taps summed in order.
template <typename T>
void conv_before_silu(
    const std::vector<const T*>& rows,
    const std::vector<float>& by_tap,
    const SegmentParams& p,
    const ChannelBlock& block,
    int r,
    float* pre) {
  const int C = p.conv_channels();
  std::fill(pre, pre + block.width, 0.0f);
  for (int i = 0; i < p.conv_kernel; ++i) {
    const T* src = rows[r + i] + block.first;
    const float* w = by_tap.data() + int64_t(i) * C + block.first;
    for (int c = 0; c < block.width; ++c) {
      pre[c] += static_cast<float>(src[c]) * w[c];
    }
  }
}

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
