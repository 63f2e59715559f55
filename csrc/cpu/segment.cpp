// CPU kernels of the fused layer segment (see segment.h).
#include "cpu/segment.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/forward.h"
#include "cpu/kernel_entry_points.h"
#include "cpu/segment_common.h"
#include "cpu/segment_stages.h"
#include "cpu/thread_pool.h"
#include "mlx/types/half_types.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

using mlx::core::bfloat16_t;
using mlx::core::float16_t;

template <typename T>
void prepare_conv(
    const SegmentParams& p,
    const T* mixed,
    const float* conv_weight,
    const T* conv_state,
    const bool* mask,
    const std::vector<ChannelBlock>& blocks,
    const ConvOutputs& out) {
  const auto histories = conv_histories(p, mixed, conv_state, mask);
  const std::vector<float> by_tap = weight_by_tap(p, conv_weight);
  const int64_t block_work =
      int64_t(p.batch) * p.tokens * kChannelBlock * p.conv_kernel;
  parallel_for(int(blocks.size()), block_work, [&](int i) {
    const ChannelBlock& block = blocks[i];
    float pre[kChannelBlock];
    for (int b = 0; b < p.batch; ++b) {
      int rank = 0;  // unmasked tokens seen so far in this row
      for (int t = 0; t < p.tokens; ++t) {
        const int64_t index = int64_t(b) * p.tokens + t;
        float* dst = out.part[block.part] + index * out.row_stride[block.part] +
            block.column;
        if (!is_kept(mask, index)) {
          std::fill(dst, dst + block.width, 0.0f);
          continue;
        }
        conv_before_silu(histories[b].rows, by_tap, p, block, rank, pre);
        for (int c = 0; c < block.width; ++c) {
          dst[c] = silu(pre[c]);
        }
        ++rank;
      }
    }
  });
}

template <typename T>
void collect_conv_state(
    const SegmentParams& p,
    const T* mixed,
    const T* conv_state_in,
    const bool* mask,
    T* conv_state_out) {
  const int C = p.conv_channels();
  const int rows_kept = p.conv_state_rows();
  const auto histories = conv_histories(p, mixed, conv_state_in, mask);
  for (int b = 0; b < p.batch; ++b) {
    const std::vector<const T*>& rows = histories[b].rows;
    const size_t first = rows.size() - rows_kept;
    T* dst = conv_state_out + int64_t(b) * rows_kept * C;
    for (int i = 0; i < rows_kept; ++i) {
      std::copy(rows[first + i], rows[first + i] + C, dst + int64_t(i) * C);
    }
  }
}

template <typename T>
void collect_conv_checkpoints(
    const SegmentParams& p,
    const T* mixed,
    const T* conv_state_in,
    const bool* mask,
    const int* checkpoints,
    T* conv_checkpoint_states) {
  const int C = p.conv_channels();
  const int rows_kept = p.conv_state_rows();
  const auto histories = conv_histories(p, mixed, conv_state_in, mask);
  for (int b = 0; b < p.batch; ++b) {
    const std::vector<const T*>& rows = histories[b].rows;
    // history_length: the carried rows and the unmasked tokens before t.
    int t = 0;
    size_t history_length = rows_kept;
    for (int n = 0; n < p.checkpoint_count; ++n) {
      for (; t < checkpoints[n]; ++t) {
        history_length += is_kept(mask, int64_t(b) * p.tokens + t) ? 1 : 0;
      }
      const size_t first = history_length - rows_kept;
      T* dst =
          conv_checkpoint_states + (int64_t(n) * p.batch + b) * rows_kept * C;
      for (int i = 0; i < rows_kept; ++i) {
        std::copy(rows[first + i], rows[first + i] + C, dst + int64_t(i) * C);
      }
    }
  }
}

template <typename T>
void prepare_gates(
    const SegmentParams& p,
    const T* mixed,
    const float* decay_parameter,
    const float* dt_bias,
    int first_head,
    int heads,
    float* g,
    float* beta) {
  const int Hv = p.value_heads;
  const int per_head = p.gate_width() / Hv;  // 1, or Dk per key channel
  std::vector<float> rate(Hv);
  for (int h = 0; h < Hv; ++h) {
    rate[h] = rate_of(p, decay_parameter[h]);
  }
  const int first = first_head * per_head;  // g's first column in the row
  const int64_t rows = int64_t(p.batch) * p.tokens;
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = mixed + r * p.mixed_qkvzba_width();
    const T* a = row + p.a_offset();
    float* g_row = g + r * heads * per_head;
    for (int h = first_head; h < first_head + heads; ++h) {
      for (int c = h * per_head; c < (h + 1) * per_head; ++c) {
        g_row[c - first] =
            log_decay(p, rate[h], static_cast<float>(a[c]) + dt_bias[c]);
      }
      beta[r * heads + h - first_head] =
          beta_of(p, static_cast<float>(row[p.b_offset() + h]));
    }
  }
}

template <typename T>
void gated_norm(
    const SegmentParams& p,
    int first_head,
    int heads,
    const float* y,
    const T* mixed,
    const float* norm_weight,
    const bool* mask,
    T* out) {
  const int Hv = p.value_heads;
  const int Dv = p.value_dim;
  const int64_t rows = int64_t(p.batch) * p.tokens;
  for (int64_t r = 0; r < rows; ++r) {
    T* dst_row = out + r * Hv * Dv + int64_t(first_head) * Dv;
    if (!is_kept(mask, r)) {
      std::fill(dst_row, dst_row + int64_t(heads) * Dv, T(0.0f));
      continue;
    }
    const T* z_row = mixed + r * p.mixed_qkvzba_width() + p.z_offset() +
        int64_t(first_head) * Dv;
    for (int h = 0; h < heads; ++h) {
      const float* y_head = y + (r * heads + h) * Dv;
      float sum_squares = 0.0f;
      for (int d = 0; d < Dv; ++d) {
        sum_squares += y_head[d] * y_head[d];
      }
      const float inv_rms = 1.0f / std::sqrt(sum_squares / Dv + p.norm_eps);
      for (int d = 0; d < Dv; ++d) {
        const float z = static_cast<float>(z_row[h * Dv + d]);
        dst_row[h * Dv + d] = static_cast<T>(
            y_head[d] * inv_rms * norm_weight[d] * output_gate(p, z));
      }
    }
  }
}

template <typename T>
void gated_delta_segment_forward(
    const SegmentParams& p, Algorithm algorithm, const SegmentBuffers<T>& io) {
  const int64_t rows = int64_t(p.batch) * p.tokens;
  const int ratio = p.value_heads / p.key_heads;
  const int per_head = p.gate_width() / p.value_heads;
  const int wave_key_heads = segment_wave_key_heads(p, thread_count());
  const int wave_heads = wave_key_heads * ratio;
  // One wave's float32 scratch. The conv output stays float32 (never rounded
  // to T) and feeds the core in place: q, k and v are column ranges of its
  // rows.
  const int wave_channels =
      2 * wave_key_heads * p.key_dim + wave_heads * p.value_dim;
  std::vector<float> qkv(rows * wave_channels);
  std::vector<float> g(rows * wave_heads * per_head);
  std::vector<float> beta(rows * wave_heads);
  std::vector<float> y(rows * wave_heads * p.value_dim);
  // A call in one wave (a decode step is one) runs the core on the call's
  // own state arrays, which a wave of every head lays out alike: copying the
  // states into and out of zeroed scratch (4 MiB at Qwen3-Next's shape,
  // allocated afresh each call) took about as long as the rest of the
  // patched layer's decode step.
  const bool one_wave = wave_key_heads >= p.key_heads;
  const int64_t state_size = int64_t(p.value_dim) * p.key_dim;
  const int64_t wave_states = one_wave ? 0 : p.batch * wave_heads * state_size;
  std::vector<float> state_in(io.state_in == nullptr ? 0 : wave_states);
  std::vector<float> state_out(wave_states);
  std::vector<float> checkpoint_states(p.checkpoint_count * wave_states);

  collect_conv_state(
      p, io.mixed_qkvzba, io.conv_state_in, io.mask, io.conv_state_out);
  if (p.checkpoint_count > 0) {
    collect_conv_checkpoints(
        p,
        io.mixed_qkvzba,
        io.conv_state_in,
        io.mask,
        io.checkpoints,
        io.conv_checkpoint_states);
  }
  for (int first = 0; first < p.key_heads; first += wave_key_heads) {
    const int key_heads = std::min(wave_key_heads, p.key_heads - first);
    const int first_head = first * ratio, heads = key_heads * ratio;
    const int qk_width = key_heads * p.key_dim;
    const int C = 2 * qk_width + heads * p.value_dim;
    const ConvOutputs conv_out{
        {qkv.data(), qkv.data() + qk_width, qkv.data() + 2 * qk_width},
        {C, C, C}};
    prepare_wave(
        p,
        io,
        first,
        key_heads,
        conv_out,
        g.data(),
        beta.data(),
        one_wave ? nullptr : state_in.data());

    GatedDeltaParams wave = p.core_params();
    wave.key_heads = key_heads;
    wave.value_heads = heads;
    CoreBuffers<float> core;
    core.q = qkv.data();
    core.k = qkv.data() + qk_width;
    core.v = qkv.data() + 2 * qk_width;
    core.qk_batch_stride = int64_t(p.tokens) * C;
    core.qk_token_stride = C;
    core.v_batch_stride = int64_t(p.tokens) * C;
    core.v_token_stride = C;
    core.g = g.data();
    core.beta = beta.data();
    core.mask = io.mask;
    core.state_in =
        io.state_in == nullptr || one_wave ? io.state_in : state_in.data();
    core.y = y.data();
    core.state_out = one_wave ? io.state_out : state_out.data();
    core.checkpoints = io.checkpoints;
    core.checkpoint_states = nullptr;
    if (p.checkpoint_count > 0) {
      core.checkpoint_states =
          one_wave ? io.checkpoint_states : checkpoint_states.data();
    }
    // This copy's core, named in full: the argument types would otherwise
    // find the dispatching cpu::gated_delta_forward too.
    MLX_GATED_DELTA_KERNEL_LEVEL::gated_delta_forward<float>(
        wave, algorithm, core);
    if (!one_wave) {
      copy_wave_states(
          p, p.batch, first_head, heads, state_out.data(), io.state_out, false);
      if (p.checkpoint_count > 0) {
        copy_wave_states(
            p,
            p.checkpoint_count * p.batch,
            first_head,
            heads,
            checkpoint_states.data(),
            io.checkpoint_states,
            false);
      }
    }

    gated_norm(
        p,
        first_head,
        heads,
        y.data(),
        io.mixed_qkvzba,
        io.norm_weight,
        io.mask,
        io.out);
  }
}

// prepare_conv and prepare_gates also run in the backward's recomputation
// (segment_backward.cpp).
#define INSTANTIATE_SEGMENT(T)                                    \
  template void gated_delta_segment_forward<T>(                   \
      const SegmentParams&, Algorithm, const SegmentBuffers<T>&); \
  template void prepare_conv<T>(                                  \
      const SegmentParams&,                                       \
      const T*,                                                   \
      const float*,                                               \
      const T*,                                                   \
      const bool*,                                                \
      const std::vector<ChannelBlock>&,                           \
      const ConvOutputs&);                                        \
  template void prepare_gates<T>(                                 \
      const SegmentParams&,                                       \
      const T*,                                                   \
      const float*,                                               \
      const float*,                                               \
      int,                                                        \
      int,                                                        \
      float*,                                                     \
      float*);

INSTANTIATE_SEGMENT(float)
INSTANTIATE_SEGMENT(float16_t)
INSTANTIATE_SEGMENT(bfloat16_t)

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
