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

}  // namespace

template <typename T>
void gated_norm_backward(
    const SegmentParams& p,
    const float* y,
    const T* mixed,
    const float* norm_weight,
    const T* d_out,
    const bool* mask,
    float* d_y,
    T* d_z,
    int64_t d_z_row_stride,
    float* d_norm_weight_rows) {
  const int Hv = p.value_heads, Dv = p.value_dim;
  const int64_t head_stride = Dv;
  const int blocks_per_row = (p.tokens + kTokenBlock - 1) / kTokenBlock;
  const int tasks = p.batch * blocks_per_row;
  // Each task's d norm_weight, summed in double and added up per batch row
  // in task order (so the result does not depend on the threads).
  std::vector<double> partial(int64_t(tasks) * Dv, 0.0);
  parallel_for(tasks, int64_t(kTokenBlock) * Hv * Dv * 12, [&](int task) {
    const int b = task / blocks_per_row;
    const int t0 = (task % blocks_per_row) * kTokenBlock;
    const int t1 = std::min(p.tokens, t0 + kTokenBlock);
    double* d_w = partial.data() + int64_t(task) * Dv;
    std::vector<float> d_n(Dv);
    for (int t = t0; t < t1; ++t) {
      const int64_t r = int64_t(b) * p.tokens + t;
      const bool kept = mask == nullptr || mask[r];
      const T* z_row = mixed + r * p.mixed_qkvzba_width() + p.z_offset();
      for (int h = 0; h < Hv; ++h) {
        const int64_t at = (r * Hv + h) * head_stride;
        float* dy = d_y + at;
        T* dz = d_z + r * d_z_row_stride + h * Dv;
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
          const float g = static_cast<float>(d_out[at + d]);
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
  for (int b = 0; b < p.batch; ++b) {
    for (int d = 0; d < Dv; ++d) {
      double sum = 0.0;
      for (int i = 0; i < blocks_per_row; ++i) {
        sum += partial[(int64_t(b) * blocks_per_row + i) * Dv + d];
      }
      d_norm_weight_rows[int64_t(b) * Dv + d] = float(sum);
    }
  }
}

template <typename T>
void prepare_conv_backward(
    const SegmentParams& p,
    const T* mixed,
    const float* weight,
    const T* conv_state,
    const T* d_conv_state_out,
    const bool* mask,
    const PrepareGradients& grad,
    T* d_mixed,
    T* d_conv_state) {
  const int C = p.conv_channels(), K = p.conv_kernel;
  const int history = p.conv_state_rows();
  const int F = p.mixed_qkvzba_width();
  const auto histories = conv_histories(p, mixed, conv_state, mask);
  const std::vector<float> by_tap = weight_by_tap(p, weight);
  const std::vector<ChannelBlock> blocks = channel_blocks(p);
  const float* d_parts[3] = {grad.dq, grad.dk, grad.dv};
  const int64_t d_stride[3] = {p.qk_width(), p.qk_width(), p.v_width()};
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
          const float* d_act =
              d_parts[block.part] + index * d_stride[block.part] + block.column;
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
    const PrepareGradients& grad,
    T* d_mixed) {
  const int Hv = p.value_heads, F = p.mixed_qkvzba_width();
  const int gate_width = p.gate_width();
  const int per_head = gate_width / Hv;  // 1, or Dk per key channel
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
      const float* dg = grad.dg + r * gate_width;
      for (int h = 0; h < Hv; ++h) {
        for (int c = h * per_head; c < (h + 1) * per_head; ++c) {
          const float u =
              static_cast<float>(row[p.a_offset() + c]) + dt_bias[c];
          const LogDecayPartials partial = log_decay_partials(p, rate[h], u);
          const float d_a = dg[c] * partial.d_u;
          d_row[p.a_offset() + c] = static_cast<T>(d_a);
          d_dt_bias[c] += d_a;
          d_rate[h] += double(dg[c]) * partial.d_rate;
        }
        const float b_in = static_cast<float>(row[p.b_offset() + h]);
        d_row[p.b_offset() + h] =
            static_cast<T>(grad.dbeta[r * Hv + h] * beta_derivative(p, b_in));
      }
    }
    for (int h = 0; h < Hv; ++h) {  // d rate / d A_log = rate
      grad.d_decay_rows[b * Hv + h] =
          float(log_rate ? d_rate[h] * rate[h] : d_rate[h]);
    }
    for (int c = 0; c < gate_width; ++c) {
      grad.d_dt_bias_rows[int64_t(b) * gate_width + c] = float(d_dt_bias[c]);
    }
  }
}

template <typename T>
void gated_delta_segment_backward(
    const SegmentParams& p,
    Algorithm forward,
    Algorithm backward,
    const SegmentBackwardBuffers<T>& io) {
  const ConvOutputs conv_out{
      {io.dq, io.dk, io.dv}, {p.qk_width(), p.qk_width(), p.v_width()}};
  prepare_conv(
      p, io.mixed_qkvzba, io.conv_weight, io.conv_state_in, io.mask, conv_out);
  prepare_gates(
      p, io.mixed_qkvzba, io.decay_parameter, io.dt_bias, io.g, io.beta);
  const float* q = io.dq;
  const float* k = io.dk;
  const float* v = io.dv;
  const GatedDeltaParams core = p.core_params();
  // This copy's core, named in full: the argument types would otherwise find
  // the dispatching cpu::gated_delta_forward and gated_delta_backward too.
  MLX_GATED_DELTA_KERNEL_LEVEL::gated_delta_forward<float>(
      core,
      forward,
      contiguous_buffers<float>(
          core,
          q,
          k,
          v,
          io.g,
          io.beta,
          io.mask,
          io.state_in,
          io.y,
          io.state_out));
  // dz goes straight to the packed row's z columns, its gradient there.
  float* d_y = io.y;
  gated_norm_backward(
      p,
      io.y,
      io.mixed_qkvzba,
      io.norm_weight,
      io.d_out,
      io.mask,
      d_y,
      io.d_mixed_qkvzba + p.z_offset(),
      p.mixed_qkvzba_width(),
      io.d_norm_weight_rows);
  MLX_GATED_DELTA_KERNEL_LEVEL::gated_delta_backward<float>(
      core,
      backward,
      BackwardBuffers<float>{
          q,
          k,
          v,
          io.g,
          io.beta,
          io.mask,
          io.state_in,
          d_y,
          io.d_state_out,
          io.dq,
          io.dk,
          io.dv,
          io.dg,
          io.dgamma,
          io.dbeta,
          io.dstate});
  const PrepareGradients grad{
      io.dq,
      io.dk,
      io.dv,
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
      grad,
      io.d_mixed_qkvzba,
      io.d_conv_state_in);
  prepare_gates_backward(
      p,
      io.mixed_qkvzba,
      io.decay_parameter,
      io.dt_bias,
      grad,
      io.d_mixed_qkvzba);
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
