// The backward of the fused layer segment's stages on the CPU
// (segment_stages.h), and the entry point of the segment's backward
// primitive (segment.h), which runs them around the core's forward and
// backward.
//
// gated_norm: out = n * w * o(z) with n = y * inv_rms per (token, value
// head) and o the output gate (silu or sigmoid), so
//   d w  = sum over tokens and heads of d_out * n * o(z)
//   d z  = d_out * n * w * o'(z)
//   d y  = inv_rms * (d_n - n * mean(d_n * n)),  d_n = d_out * w * o(z).
// prepare_conv: each block of channels walks each batch row's conv history
// (segment_common.h) backwards through the taps, keeping the gradient of the
// last K rows before SiLU.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/backward.h"
#include "cpu/forward.h"
#include "cpu/kernel_entry_points.h"
#include "cpu/segment.h"
#include "cpu/segment_common.h"
#include "cpu/segment_stages.h"
#include "cpu/thread_pool.h"
#include "mlx/types/half_types.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

using mlx::core::bfloat16_t;
using mlx::core::float16_t;

namespace {

constexpr int kTokenBlock = 64;

// gated_norm_backward's tasks: one per batch row and block of kTokenBlock
// tokens.
int gated_norm_tasks(const SegmentParams& p) {
  return p.batch * ((p.tokens + kTokenBlock - 1) / kTokenBlock);
}

}  // namespace

template <typename T>
void gated_norm_backward(
    const SegmentParams& p,
    int first_head,
    int heads,
    const float* y,
    const T* mixed,
    const float* norm_weight,
    const T* d_out,
    const bool* mask,
    float* d_y,
    T* d_z,
    int64_t d_z_row_stride,
    double* d_norm_weight_tasks) {
  const int Hv = p.value_heads, Dv = p.value_dim;
  const int blocks_per_row = (p.tokens + kTokenBlock - 1) / kTokenBlock;
  const int tasks = gated_norm_tasks(p);
  parallel_for(tasks, int64_t(kTokenBlock) * heads * Dv * 12, [&](int task) {
    const int b = task / blocks_per_row;
    const int t0 = (task % blocks_per_row) * kTokenBlock;
    const int t1 = std::min(p.tokens, t0 + kTokenBlock);
    double* d_w = d_norm_weight_tasks + int64_t(task) * Dv;
    std::vector<float> d_n(Dv);
    for (int t = t0; t < t1; ++t) {
      const int64_t r = int64_t(b) * p.tokens + t;
      const bool kept = mask == nullptr || mask[r];
      const T* z_row = mixed + r * p.mixed_qkvzba_width() + p.z_offset();
      for (int h = first_head; h < first_head + heads; ++h) {
        const int64_t at = (r * heads + h - first_head) * Dv;
        const int64_t out_at = (r * Hv + h) * Dv;
        float* dy = d_y + at;
        T* dz = d_z + r * d_z_row_stride + (h - first_head) * Dv;
        if (!kept) {
          std::fill(dy, dy + Dv, 0.0f);
          std::fill(dz, dz + Dv, T(0.0f));
          continue;
        }
        const float* yh = y + at;
        float sum_squares = 0.0f;
        for (int d = 0; d < Dv; ++d) {
          sum_squares += yh[d] * yh[d];
        }
        const float inv_rms = 1.0f / std::sqrt(sum_squares / Dv + p.norm_eps);
        float dn_dot_n = 0.0f;
        for (int d = 0; d < Dv; ++d) {
          const float z = static_cast<float>(z_row[h * Dv + d]);
          const float gate = output_gate(p, z);
          const float n = yh[d] * inv_rms;
          const float g = static_cast<float>(d_out[out_at + d]);
          d_w[d] += double(g) * n * gate;
          dz[d] = static_cast<T>(
              g * n * norm_weight[d] * output_gate_derivative(p, z));
          d_n[d] = g * norm_weight[d] * gate;
          dn_dot_n += d_n[d] * n;
        }
        const float mean = dn_dot_n / Dv;
        for (int d = 0; d < Dv; ++d) {
          dy[d] = inv_rms * (d_n[d] - yh[d] * inv_rms * mean);
        }
      }
    }
  });
}

template <typename T>
void prepare_conv_backward(
    const SegmentParams& p,
    const T* mixed,
    const float* weight,
    const T* conv_state,
    const T* d_conv_state_out,
    const bool* mask,
    const std::vector<ChannelBlock>& blocks,
    const PrepareGradients& grad,
    T* d_mixed,
    T* d_conv_state) {
  const int C = p.conv_channels(), K = p.conv_kernel;
  const int history = p.conv_state_rows();
  const int F = p.mixed_qkvzba_width();
  const auto histories = conv_histories(p, mixed, conv_state, mask);
  const std::vector<float> by_tap = weight_by_tap(p, weight);
  const float* d_parts[3] = {grad.dq, grad.dk, grad.dv};
  const int64_t block_work =
      int64_t(p.batch) * p.tokens * kChannelBlock * 3 * K;
  parallel_for(int(blocks.size()), block_work, [&](int block_index) {
    const ChannelBlock& block = blocks[block_index];
    const int width = block.width;
    // d_pre of the last K compact rows, row r at slot r % K.
    std::vector<float> recent(int64_t(K) * kChannelBlock);
    float pre[kChannelBlock];
    for (int b = 0; b < p.batch; ++b) {
      const ConvHistory<T>& h = histories[b];
      const int count = int(h.token_of_rank.size());
      // This block's d conv_weight over the row, tap-major, summed in double.
      std::vector<double> d_weight(int64_t(K) * kChannelBlock, 0.0);
      for (int t = 0; t < p.tokens; ++t) {  // masked tokens enter no window
        const int64_t index = int64_t(b) * p.tokens + t;
        if (!is_kept(mask, index)) {
          T* dst = d_mixed + index * F + block.first;
          std::fill(dst, dst + width, T(0.0f));
        }
      }
      // Compact position `at` is read by the conv rows at - j (tap j); its
      // gradient is sum_j d_pre[at - j] * weight[:, j] once d_pre[at] is known.
      for (int at = 0; at < history + count; ++at) {
        float* d_pre = recent.data() + int64_t(at % K) * kChannelBlock;
        if (at < count) {
          const int64_t index = int64_t(b) * p.tokens + h.token_of_rank[at];
          const float* d_act = d_parts[block.part] +
              index * grad.row_stride[block.part] + block.column;
          conv_before_silu(h.rows, by_tap, p, block, at, pre);
          for (int c = 0; c < width; ++c) {
            const float s = sigmoid(pre[c]);
            d_pre[c] = d_act[c] * s * (1.0f + pre[c] * (1.0f - s));
          }
          for (int i = 0; i < K; ++i) {
            const T* src = h.rows[at + i] + block.first;
            double* dw = d_weight.data() + int64_t(i) * kChannelBlock;
            for (int c = 0; c < width; ++c) {
              dw[c] += double(d_pre[c]) * static_cast<float>(src[c]);
            }
          }
        } else {
          std::fill(d_pre, d_pre + width, 0.0f);
        }
        // The new conv state is compact positions count .. count+K-2.
        float sum[kChannelBlock];
        if (at >= count) {
          const T* d_carried = d_conv_state_out +
              (int64_t(b) * history + (at - count)) * C + block.first;
          for (int c = 0; c < width; ++c) {
            sum[c] = static_cast<float>(d_carried[c]);
          }
        } else {
          std::fill(sum, sum + width, 0.0f);
        }
        for (int j = 0; j < K && j <= at; ++j) {
          const float* d_row =
              recent.data() + int64_t((at - j) % K) * kChannelBlock;
          const float* w = by_tap.data() + int64_t(j) * C + block.first;
          for (int c = 0; c < width; ++c) {
            sum[c] += d_row[c] * w[c];
          }
        }
        T* dst = at < history ? d_conv_state + (int64_t(b) * history + at) * C
                              : d_mixed +
                (int64_t(b) * p.tokens + h.token_of_rank[at - history]) * F;
        for (int c = 0; c < width; ++c) {
          dst[block.first + c] = static_cast<T>(sum[c]);
        }
      }
      float* d_weight_row = grad.d_weight_rows + int64_t(b) * C * K;
      for (int c = 0; c < width; ++c) {
        for (int i = 0; i < K; ++i) {
          d_weight_row[int64_t(block.first + c) * K + i] =
              float(d_weight[int64_t(i) * kChannelBlock + c]);
        }
      }
    }
  });
}

template <typename T>
void prepare_gates_backward(
    const SegmentParams& p,
    const T* mixed,
    const float* decay_parameter,
    const float* dt_bias,
    int first_head,
    int heads,
    const PrepareGradients& grad,
    T* d_mixed) {
  const int Hv = p.value_heads, F = p.mixed_qkvzba_width();
  const int gate_width = p.gate_width();
  const int per_head = gate_width / Hv;  // 1, or Dk per key channel
  const int first = first_head * per_head;  // dg's first column in the row
  const int last = (first_head + heads) * per_head;
  const bool log_rate =
      p.decay_parameterization == DecayParameterization::LogRate;
  std::vector<float> rate(Hv);
  for (int h = 0; h < Hv; ++h) {
    rate[h] = rate_of(p, decay_parameter[h]);
  }
  for (int b = 0; b < p.batch; ++b) {
    std::vector<double> d_rate(Hv, 0.0), d_dt_bias(gate_width, 0.0);
    for (int t = 0; t < p.tokens; ++t) {
      const int64_t r = int64_t(b) * p.tokens + t;
      const T* row = mixed + r * F;
      T* d_row = d_mixed + r * F;
      const float* dg = grad.dg + r * heads * per_head;
      for (int h = first_head; h < first_head + heads; ++h) {
        for (int c = h * per_head; c < (h + 1) * per_head; ++c) {
          const float u =
              static_cast<float>(row[p.a_offset() + c]) + dt_bias[c];
          const LogDecayPartials partial = log_decay_partials(p, rate[h], u);
          const float d_a = dg[c - first] * partial.d_u;
          d_row[p.a_offset() + c] = static_cast<T>(d_a);
          d_dt_bias[c] += d_a;
          d_rate[h] += double(dg[c - first]) * partial.d_rate;
        }
        const float b_in = static_cast<float>(row[p.b_offset() + h]);
        d_row[p.b_offset() + h] = static_cast<T>(
            grad.dbeta[r * heads + h - first_head] * beta_derivative(p, b_in));
      }
    }
    for (int h = first_head; h < first_head + heads; ++h) {
      // d rate / d A_log = rate
      grad.d_decay_rows[b * Hv + h] =
          float(log_rate ? d_rate[h] * rate[h] : d_rate[h]);
    }
    for (int c = first; c < last; ++c) {
      grad.d_dt_bias_rows[int64_t(b) * gate_width + c] = float(d_dt_bias[c]);
    }
  }
}

namespace {

// d norm_weight per batch row: gated_norm_backward's tasks' sums added up in
// task order (so the result does not depend on the threads).
void gated_norm_weight_rows(
    const SegmentParams& p,
    const double* d_norm_weight_tasks,
    float* d_norm_weight_rows) {
  const int Dv = p.value_dim;
  const int blocks_per_row = gated_norm_tasks(p) / p.batch;
  for (int b = 0; b < p.batch; ++b) {
    for (int d = 0; d < Dv; ++d) {
      double sum = 0.0;
      for (int i = 0; i < blocks_per_row; ++i) {
        sum += d_norm_weight_tasks[(int64_t(b) * blocks_per_row + i) * Dv + d];
      }
      d_norm_weight_rows[int64_t(b) * Dv + d] = float(sum);
    }
  }
}

}  // namespace

template <typename T>
void gated_delta_segment_backward(
    const SegmentParams& p,
    Algorithm forward,
    Algorithm backward,
    const SegmentBackwardBuffers<T>& io) {
  const int ratio = p.value_heads / p.key_heads;
  const GatedDeltaParams core = p.core_params();
  // Each task's d norm_weight, summed in double over its tokens and the
  // waves' heads, then added up per batch row in task order. The waves add
  // their heads' terms wave by wave where one pass over every head added them
  // token by token: the same terms in another order, whose float32 result
  // differs only where the double sum lies within a few of a double's
  // roundings of a boundary between floats.
  std::vector<double> d_norm_weight_tasks(
      int64_t(gated_norm_tasks(p)) * p.value_dim, 0.0);
  for (int first = 0; first < p.key_heads; first += io.wave_key_heads) {
    const int key_heads = std::min(io.wave_key_heads, p.key_heads - first);
    const int first_head = first * ratio, heads = key_heads * ratio;
    GatedDeltaParams wave = core;
    wave.key_heads = key_heads;
    wave.value_heads = heads;
    const std::vector<ChannelBlock> blocks =
        channel_blocks(p, first, key_heads);
    const int64_t qk_row = int64_t(key_heads) * p.key_dim;
    const int64_t v_row = int64_t(heads) * p.value_dim;
    prepare_wave(
        p,
        io,
        first,
        key_heads,
        ConvOutputs{{io.dq, io.dk, io.dv}, {qk_row, qk_row, v_row}},
        io.g,
        io.beta,
        io.wave_state_in);
    copy_wave_states(
        p,
        p.batch,
        first_head,
        heads,
        io.d_state_out,
        io.wave_d_state_out,
        true);
    const float* q = io.dq;
    const float* k = io.dk;
    const float* v = io.dv;
    // This copy's core, named in full: the argument types would otherwise
    // find the dispatching cpu::gated_delta_forward and gated_delta_backward
    // too.
    MLX_GATED_DELTA_KERNEL_LEVEL::gated_delta_forward<float>(
        wave,
        forward,
        contiguous_buffers<float>(
            wave,
            q,
            k,
            v,
            io.g,
            io.beta,
            io.mask,
            io.wave_state_in,
            io.y,
            io.state_out));
    // dz goes straight to the packed row's z columns, its gradient there.
    float* d_y = io.y;
    gated_norm_backward(
        p,
        first_head,
        heads,
        io.y,
        io.mixed_qkvzba,
        io.norm_weight,
        io.d_out,
        io.mask,
        d_y,
        io.d_mixed_qkvzba + p.z_offset() + int64_t(first_head) * p.value_dim,
        p.mixed_qkvzba_width(),
        d_norm_weight_tasks.data());
    MLX_GATED_DELTA_KERNEL_LEVEL::gated_delta_backward<float>(
        wave,
        backward,
        BackwardBuffers<float>{
            q,
            k,
            v,
            io.g,
            io.beta,
            io.mask,
            io.wave_state_in,
            d_y,
            io.wave_d_state_out,
            io.dq,
            io.dk,
            io.dv,
            io.dg,
            io.dgamma,
            io.dbeta,
            io.wave_dstate});
    copy_wave_states(
        p, p.batch, first_head, heads, io.wave_dstate, io.dstate, false);
    const PrepareGradients grad{
        io.dq,
        io.dk,
        io.dv,
        {qk_row, qk_row, v_row},
        io.dg,
        io.dbeta,
        io.d_conv_weight_rows,
        io.d_decay_parameter_rows,
        io.d_dt_bias_rows};
    prepare_conv_backward(
        p,
        io.mixed_qkvzba,
        io.conv_weight,
        io.conv_state_in,
        io.d_conv_state_out,
        io.mask,
        blocks,
        grad,
        io.d_mixed_qkvzba,
        io.d_conv_state_in);
    prepare_gates_backward(
        p,
        io.mixed_qkvzba,
        io.decay_parameter,
        io.dt_bias,
        first_head,
        heads,
        grad,
        io.d_mixed_qkvzba);
  }
  gated_norm_weight_rows(p, d_norm_weight_tasks.data(), io.d_norm_weight_rows);
}

#define INSTANTIATE_SEGMENT_BACKWARD(T)          \
  template void gated_delta_segment_backward<T>( \
      const SegmentParams&,                      \
      Algorithm,                                 \
      Algorithm,                                 \
      const SegmentBackwardBuffers<T>&);

INSTANTIATE_SEGMENT_BACKWARD(float)
INSTANTIATE_SEGMENT_BACKWARD(float16_t)
INSTANTIATE_SEGMENT_BACKWARD(bfloat16_t)

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
