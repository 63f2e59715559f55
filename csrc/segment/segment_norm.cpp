// The gated RMSNorm's vjp on the CPU (segment_norm.h).
//
// out = n * w * silu(z) with n = y * inv_rms per (token, value head), so
//   d w  = sum over tokens and heads of d_out * n * silu(z)
//   d z  = d_out * n * w * silu'(z)
//   d y  = inv_rms * (d_n - n * mean(d_n * n)),  d_n = d_out * w * silu(z).
#include "segment/segment_norm.h"

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

constexpr int kTokenBlock = 64;

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
    float* d_norm_weight_rows) {
  const int Hv = p.value_heads, Dv = p.value_dim;
  const int64_t head_stride = Dv;
  const int blocks_per_row = (p.tokens + kTokenBlock - 1) / kTokenBlock;
  const int tasks = p.batch * blocks_per_row;
  // Each task's d norm_weight, summed in double and added up per batch row
  // in task order (so the result does not depend on the threads).
  std::vector<double> partial(int64_t(tasks) * Dv, 0.0);
  cpu::parallel_for(tasks, int64_t(kTokenBlock) * Hv * Dv * 12, [&](int task) {
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
        T* dz = d_z + at;
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
          const float s = 1.0f / (1.0f + std::exp(-z));
          const float silu = z * s;
          const float n = yh[d] * inv_rms;
          const float g = static_cast<float>(d_out[at + d]);
          d_w[d] += double(g) * n * silu;
          dz[d] = static_cast<T>(
              g * n * norm_weight[d] * (s * (1.0f + z * (1.0f - s))));
          d_n[d] = g * norm_weight[d] * silu;
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

SegmentParams params_of(const SegmentParams& options, const mx::array& mixed) {
  SegmentParams p = options;
  p.batch = mixed.shape(0);
  p.tokens = mixed.shape(1);
  return p;
}

}  // namespace

std::vector<mx::Shape> GatedDeltaSegmentNormVJP::output_shapes(
    const std::vector<mx::array>& inputs) {
  const SegmentParams p = params_of(options_, inputs[1]);
  return {
      {p.batch, p.tokens, p.value_heads, p.value_dim},
      {p.batch, p.tokens, p.v_width()},
      {p.batch, p.value_dim}};
}

bool GatedDeltaSegmentNormVJP::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatedDeltaSegmentNormVJP&>(other).options_;
  return options_.key_heads == o.key_heads &&
      options_.value_heads == o.value_heads && options_.key_dim == o.key_dim &&
      options_.value_dim == o.value_dim && options_.norm_eps == o.norm_eps &&
      options_.has_mask == o.has_mask;
}

void GatedDeltaSegmentNormVJP::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (auto& output : outputs) {
    output.set_data(mx::allocator::malloc(output.nbytes()));
  }
  const SegmentParams p = params_of(options_, inputs[1]);
  with_activation_type(
      inputs[1].dtype(), "GatedDeltaSegmentNormVJP", [&]<typename T>(T) {
        const float* y = inputs[0].data<float>();
        const T* mixed = inputs[1].data<T>();
        const float* norm_weight = inputs[2].data<float>();
        const T* d_out = inputs[3].data<T>();
        const bool* mask = p.has_mask ? inputs[4].data<bool>() : nullptr;
        float* d_y = outputs[0].data<float>();
        T* d_z = outputs[1].data<T>();
        float* d_norm_weight_rows = outputs[2].data<float>();
        auto& encoder = mx::cpu::get_command_encoder(stream());
        for (const auto& input : inputs) {
          encoder.set_input_array(input);
        }
        for (auto& output : outputs) {
          encoder.set_output_array(output);
        }
        encoder.dispatch([=]() {
          gated_norm_backward<T>(
              p,
              y,
              mixed,
              norm_weight,
              d_out,
              mask,
              d_y,
              d_z,
              d_norm_weight_rows);
        });
      });
}

void GatedDeltaSegmentNormVJP::eval_gpu(
    const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      std::string("mlx_gated_delta: ") + name() +
      " runs on the CPU only (the segment's backward builds it there).");
}

// Every input but the norm weight carries the batch.
std::pair<std::vector<mx::array>, std::vector<int>>
GatedDeltaSegmentNormVJP::vmap(
    const std::vector<mx::array>& inputs, const std::vector<int>& axes) {
  if (axes[2] >= 0) {
    throw std::invalid_argument(
        "mlx_gated_delta.gated_delta_segment: vmap over the layer's weights "
        "is not supported; map over the activations and the states only.");
  }
  const int size = vmap_size(inputs, axes);
  std::vector<mx::array> folded = inputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (i != 2) {
      folded[i] = fold_into_batch(inputs[i], axes[i], size, stream());
    }
  }
  auto outputs = mx::array::make_arrays(
      output_shapes(folded),
      {mx::float32, folded[1].dtype(), mx::float32},
      std::make_shared<GatedDeltaSegmentNormVJP>(stream(), options_),
      folded);
  for (auto& out : outputs) {
    out = unfold_from_batch(out, size, stream());
  }
  return {outputs, std::vector<int>(outputs.size(), 0)};
}

}  // namespace mlx_gated_delta
