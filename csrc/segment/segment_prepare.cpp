// The segment's prepare stage and its vjp on the CPU (segment_prepare.h).
//
// Both conv kernels walk each batch row's conv history (the K-1 carried
// conv-state rows, then the unmasked tokens, as the forward's prepare_conv sees
// them) split into blocks of channels, one block per task: the depthwise conv
// has no dependency across channels, so every output element has one writer.
#include "segment/segment_prepare.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/activation_type.h"
#include "core/vmap_fold.h"
#include "cpu/thread_pool.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace mx = mlx::core;

namespace mlx_gated_delta {

namespace {

constexpr int kChannelBlock = 64;

float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}

float softplus(float x) {
  return std::fmax(x, 0.0f) + std::log1p(std::exp(-std::fabs(x)));
}

bool is_kept(const bool* mask, int64_t index) {
  return mask == nullptr || mask[index];
}

// The rows one batch row's conv reads, oldest first: the K-1 carried rows,
// then each unmasked token's packed row (its first C columns are q|k|v). And
// the token of each unmasked rank.
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

// A block of at most kChannelBlock conv channels [first, first + width)
// inside one of q, k and v, which are [B*T, stride] with the block at column
// `column`.
struct ChannelBlock {
  int first;
  int width;
  int part;  // 0, 1, 2: q, k, v
  int column;
  int stride;
};

std::vector<ChannelBlock> channel_blocks(const SegmentParams& p) {
  std::vector<ChannelBlock> blocks;
  const int widths[3] = {p.qk_width(), p.qk_width(), p.v_width()};
  int first = 0;
  for (int part = 0; part < 3; ++part) {
    for (int column = 0; column < widths[part]; column += kChannelBlock) {
      const int width = std::min(kChannelBlock, widths[part] - column);
      blocks.push_back({first + column, width, part, column, widths[part]});
    }
    first += widths[part];
  }
  return blocks;
}

// The [C, K] conv weight tap-major ([K, C]), so that the channel loops read
// every operand with unit stride.
std::vector<float> weight_by_tap(const SegmentParams& p, const float* weight) {
  const int C = p.conv_channels(), K = p.conv_kernel;
  std::vector<float> by_tap(int64_t(K) * C);
  for (int c = 0; c < C; ++c) {
    for (int i = 0; i < K; ++i) {
      by_tap[int64_t(i) * C + c] = weight[int64_t(c) * K + i];
    }
  }
  return by_tap;
}

// The conv output before SiLU at compact row r (ranks from 0), for the
// block's channels, in the order of the forward's prepare_conv.
template <typename T>
void conv_rows(
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

float rate_of(const SegmentParams& p, float decay_parameter) {
  return p.decay_parameterization == DecayParameterization::LogRate
      ? -std::exp(decay_parameter)
      : decay_parameter;
}

struct PrepareOutputs {
  float* q;
  float* k;
  float* v;
  float* g;
  float* beta;
};

// prepare_conv, writing q, k and v apart: silu(causal conv) per token, 0 for
// a masked token.
template <typename T>
void prepare_conv(
    const SegmentParams& p,
    const T* mixed,
    const float* weight,
    const T* conv_state,
    const bool* mask,
    const PrepareOutputs& out) {
  const auto histories = conv_histories(p, mixed, conv_state, mask);
  const std::vector<float> by_tap = weight_by_tap(p, weight);
  const std::vector<ChannelBlock> blocks = channel_blocks(p);
  float* parts[3] = {out.q, out.k, out.v};
  const int64_t block_work =
      int64_t(p.batch) * p.tokens * kChannelBlock * p.conv_kernel;
  cpu::parallel_for(int(blocks.size()), block_work, [&](int i) {
    const ChannelBlock& block = blocks[i];
    float pre[kChannelBlock];
    for (int b = 0; b < p.batch; ++b) {
      int rank = 0;
      for (int t = 0; t < p.tokens; ++t) {
        const int64_t index = int64_t(b) * p.tokens + t;
        float* dst = parts[block.part] + index * block.stride + block.column;
        if (!is_kept(mask, index)) {
          std::fill(dst, dst + block.width, 0.0f);
          continue;
        }
        conv_rows(histories[b].rows, by_tap, p, block, rank, pre);
        for (int c = 0; c < block.width; ++c) {
          dst[c] = pre[c] * sigmoid(pre[c]);
        }
        ++rank;
      }
    }
  });
}

// prepare_gates: g = rate * softplus(a + dt_bias), beta = sigmoid(b).
template <typename T>
void prepare_gates(
    const SegmentParams& p,
    const T* mixed,
    const float* decay_parameter,
    const float* dt_bias,
    const PrepareOutputs& out) {
  const int Hv = p.value_heads;
  const int64_t rows = int64_t(p.batch) * p.tokens;
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = mixed + r * p.mixed_qkvzba_width();
    for (int h = 0; h < Hv; ++h) {
      const float a = static_cast<float>(row[p.a_offset() + h]);
      out.g[r * Hv + h] =
          rate_of(p, decay_parameter[h]) * softplus(a + dt_bias[h]);
      out.beta[r * Hv + h] = sigmoid(static_cast<float>(row[p.b_offset() + h]));
    }
  }
}

struct PrepareGradients {
  const float* dq;
  const float* dk;
  const float* dv;
  const float* dg;
  const float* dbeta;
  float* d_weight_rows;  // [B, C, K]
  float* d_decay_rows;  // [B, Hv]
  float* d_dt_bias_rows;  // [B, Hv]
};

// prepare_conv_backward: the gradient of prepare_conv and collect_conv_state
// into the packed rows' q|k|v columns, the conv state and the conv weight.
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
  const int64_t block_work =
      int64_t(p.batch) * p.tokens * kChannelBlock * 3 * K;
  cpu::parallel_for(int(blocks.size()), block_work, [&](int block_index) {
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
              d_parts[block.part] + index * block.stride + block.column;
          conv_rows(h.rows, by_tap, p, block, at, pre);
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

// prepare_gates_backward: the gradient of prepare_gates into the packed
// rows' b and a columns, the decay parameter and dt_bias; the z columns take
// the gated norm's dz.
template <typename T>
void prepare_gates_backward(
    const SegmentParams& p,
    const T* mixed,
    const float* decay_parameter,
    const float* dt_bias,
    const PrepareGradients& grad,
    const T* dz,
    T* d_mixed) {
  const int Hv = p.value_heads, F = p.mixed_qkvzba_width();
  const int v_width = p.v_width();
  const bool log_rate =
      p.decay_parameterization == DecayParameterization::LogRate;
  for (int b = 0; b < p.batch; ++b) {
    std::vector<double> d_rate(Hv, 0.0), d_dt_bias(Hv, 0.0);
    for (int t = 0; t < p.tokens; ++t) {
      const int64_t r = int64_t(b) * p.tokens + t;
      const T* row = mixed + r * F;
      T* d_row = d_mixed + r * F;
      std::copy(dz + r * v_width, dz + (r + 1) * v_width, d_row + p.z_offset());
      for (int h = 0; h < Hv; ++h) {
        const float rate = rate_of(p, decay_parameter[h]);
        const float gate_input =
            static_cast<float>(row[p.a_offset() + h]) + dt_bias[h];
        const float dg = grad.dg[r * Hv + h];
        const float d_a = dg * rate * sigmoid(gate_input);
        d_row[p.a_offset() + h] = static_cast<T>(d_a);
        d_dt_bias[h] += d_a;
        d_rate[h] += double(dg) * softplus(gate_input);
        const float beta = sigmoid(static_cast<float>(row[p.b_offset() + h]));
        d_row[p.b_offset() + h] =
            static_cast<T>(grad.dbeta[r * Hv + h] * beta * (1.0f - beta));
      }
    }
    for (int h = 0; h < Hv; ++h) {  // d rate / d A_log = rate
      const double rate = rate_of(p, decay_parameter[h]);
      grad.d_decay_rows[b * Hv + h] =
          float(log_rate ? d_rate[h] * rate : d_rate[h]);
      grad.d_dt_bias_rows[b * Hv + h] = float(d_dt_bias[h]);
    }
  }
}

SegmentParams params_of(const SegmentParams& options, const mx::array& mixed) {
  SegmentParams p = options;
  p.batch = mixed.shape(0);
  p.tokens = mixed.shape(1);
  return p;
}

void allocate(std::vector<mx::array>& outputs) {
  for (auto& output : outputs) {
    output.set_data(mx::allocator::malloc(output.nbytes()));
  }
}

template <typename Task>
void dispatch(
    mx::Stream stream,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    Task&& task) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& input : inputs) {
    encoder.set_input_array(input);
  }
  for (auto& output : outputs) {
    encoder.set_output_array(output);
  }
  encoder.dispatch(std::forward<Task>(task));
}

[[noreturn]] void cpu_only(const char* name) {
  throw std::runtime_error(
      std::string("mlx_gated_delta: ") + name +
      " runs on the CPU only (the segment's backward builds it there).");
}

// vmap by folding: every input but the weights carries the batch.
std::vector<mx::array> fold_batch_inputs(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes,
    int size,
    mx::Stream s) {
  for (int i : {kPrepareConvWeight, kPrepareDecayParameter, kPrepareDtBias}) {
    if (axes[i] >= 0) {
      throw std::invalid_argument(
          "mlx_gated_delta.gated_delta_segment: vmap over the layer's weights "
          "is not supported; map over the activations and the states only.");
    }
  }
  std::vector<mx::array> folded = inputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (i != kPrepareConvWeight && i != kPrepareDecayParameter &&
        i != kPrepareDtBias) {
      folded[i] = fold_into_batch(inputs[i], axes[i], size, s);
    }
  }
  return folded;
}

}  // namespace

std::vector<mx::Shape> GatedDeltaSegmentPrepare::output_shapes(
    const std::vector<mx::array>& inputs) {
  const SegmentParams p = params_of(options_, inputs[kPrepareMixed]);
  return {
      {p.batch, p.tokens, p.key_heads, p.key_dim},
      {p.batch, p.tokens, p.key_heads, p.key_dim},
      {p.batch, p.tokens, p.value_heads, p.value_dim},
      {p.batch, p.tokens, p.value_heads},
      {p.batch, p.tokens, p.value_heads}};
}

bool GatedDeltaSegmentPrepare::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatedDeltaSegmentPrepare&>(other).options_;
  return options_.key_heads == o.key_heads &&
      options_.value_heads == o.value_heads && options_.key_dim == o.key_dim &&
      options_.value_dim == o.value_dim &&
      options_.decay_parameterization == o.decay_parameterization &&
      options_.has_mask == o.has_mask;
}

void GatedDeltaSegmentPrepare::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  allocate(outputs);
  const SegmentParams p = params_of(options_, inputs[kPrepareMixed]);
  with_activation_type(
      inputs[kPrepareMixed].dtype(),
      "GatedDeltaSegmentPrepare",
      [&]<typename T>(T) {
        const T* mixed = inputs[kPrepareMixed].data<T>();
        const float* weight = inputs[kPrepareConvWeight].data<float>();
        const float* decay = inputs[kPrepareDecayParameter].data<float>();
        const float* dt_bias = inputs[kPrepareDtBias].data<float>();
        const T* conv_state = inputs[kPrepareConvState].data<T>();
        const bool* mask =
            p.has_mask ? inputs[kPrepareConvState + 1].data<bool>() : nullptr;
        const PrepareOutputs out{
            outputs[0].data<float>(),
            outputs[1].data<float>(),
            outputs[2].data<float>(),
            outputs[3].data<float>(),
            outputs[4].data<float>()};
        dispatch(stream(), inputs, outputs, [=]() {
          prepare_conv<T>(p, mixed, weight, conv_state, mask, out);
          prepare_gates<T>(p, mixed, decay, dt_bias, out);
        });
      });
}

void GatedDeltaSegmentPrepare::eval_gpu(
    const std::vector<mx::array>&, std::vector<mx::array>&) {
  cpu_only(name());
}

std::pair<std::vector<mx::array>, std::vector<int>>
GatedDeltaSegmentPrepare::vmap(
    const std::vector<mx::array>& inputs, const std::vector<int>& axes) {
  const int size = vmap_size(inputs, axes);
  const std::vector<mx::array> folded =
      fold_batch_inputs(inputs, axes, size, stream());
  auto outputs = mx::array::make_arrays(
      output_shapes(folded),
      std::vector<mx::Dtype>(5, mx::float32),
      std::make_shared<GatedDeltaSegmentPrepare>(stream(), options_),
      folded);
  for (auto& out : outputs) {
    out = unfold_from_batch(out, size, stream());
  }
  return {outputs, std::vector<int>(outputs.size(), 0)};
}

std::vector<mx::Shape> GatedDeltaSegmentPrepareVJP::output_shapes(
    const std::vector<mx::array>& inputs) {
  const SegmentParams p = params_of(options_, inputs[kPrepareMixed]);
  return {
      {p.batch, p.tokens, p.mixed_qkvzba_width()},
      {p.batch, p.conv_channels(), p.conv_kernel},
      {p.batch, p.value_heads},
      {p.batch, p.value_heads},
      {p.batch, p.conv_state_rows(), p.conv_channels()}};
}

bool GatedDeltaSegmentPrepareVJP::is_equivalent(
    const mx::Primitive& other) const {
  const auto& o =
      static_cast<const GatedDeltaSegmentPrepareVJP&>(other).options_;
  return options_.key_heads == o.key_heads &&
      options_.value_heads == o.value_heads && options_.key_dim == o.key_dim &&
      options_.value_dim == o.value_dim &&
      options_.decay_parameterization == o.decay_parameterization &&
      options_.has_mask == o.has_mask;
}

void GatedDeltaSegmentPrepareVJP::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  allocate(outputs);
  const SegmentParams p = params_of(options_, inputs[kPrepareMixed]);
  with_activation_type(
      inputs[kPrepareMixed].dtype(),
      "GatedDeltaSegmentPrepareVJP",
      [&]<typename T>(T) {
        const int d = kPrepareCotangents;
        const T* mixed = inputs[kPrepareMixed].data<T>();
        const float* weight = inputs[kPrepareConvWeight].data<float>();
        const float* decay = inputs[kPrepareDecayParameter].data<float>();
        const float* dt_bias = inputs[kPrepareDtBias].data<float>();
        const T* conv_state = inputs[kPrepareConvState].data<T>();
        const T* d_conv_state_out = inputs[d + 6].data<T>();
        const bool* mask = p.has_mask
            ? inputs[d + kPrepareCotangentCount].data<bool>()
            : nullptr;
        const PrepareGradients grad{
            inputs[d].data<float>(),
            inputs[d + 1].data<float>(),
            inputs[d + 2].data<float>(),
            inputs[d + 3].data<float>(),
            inputs[d + 4].data<float>(),
            outputs[1].data<float>(),
            outputs[2].data<float>(),
            outputs[3].data<float>()};
        const T* dz = inputs[d + 5].data<T>();
        T* d_mixed = outputs[0].data<T>();
        T* d_conv_state = outputs[4].data<T>();
        dispatch(stream(), inputs, outputs, [=]() {
          prepare_conv_backward<T>(
              p,
              mixed,
              weight,
              conv_state,
              d_conv_state_out,
              mask,
              grad,
              d_mixed,
              d_conv_state);
          prepare_gates_backward<T>(
              p, mixed, decay, dt_bias, grad, dz, d_mixed);
        });
      });
}

void GatedDeltaSegmentPrepareVJP::eval_gpu(
    const std::vector<mx::array>&, std::vector<mx::array>&) {
  cpu_only(name());
}

std::pair<std::vector<mx::array>, std::vector<int>>
GatedDeltaSegmentPrepareVJP::vmap(
    const std::vector<mx::array>& inputs, const std::vector<int>& axes) {
  const int size = vmap_size(inputs, axes);
  const std::vector<mx::array> folded =
      fold_batch_inputs(inputs, axes, size, stream());
  const mx::Dtype dtype = folded[kPrepareMixed].dtype();
  auto outputs = mx::array::make_arrays(
      output_shapes(folded),
      {dtype, mx::float32, mx::float32, mx::float32, dtype},
      std::make_shared<GatedDeltaSegmentPrepareVJP>(stream(), options_),
      folded);
  for (auto& out : outputs) {
    out = unfold_from_batch(out, size, stream());
  }
  return {outputs, std::vector<int>(outputs.size(), 0)};
}

}  // namespace mlx_gated_delta
