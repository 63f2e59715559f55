// Runs a few small shapes through every Metal kernel (the core's and the fused
// segment's) in the emulator, for the ThreadSanitizer and AddressSanitizer
// builds of run_sanitizers.sh. Fails on a sanitizer report (the sanitizer's
// exit code), on any emulator error (sentinel guards, divergence, deadlock,
// limits) and on a non-finite output; agreement with the oracle is the pytest
// suite's job.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "executor.h"
#include "metal/plan/plan.h"

using namespace mlx_gated_delta;
using namespace mlx_gated_delta::metal;

namespace {

struct Shape {
  const char* name;
  Algorithm algorithm;
  ActivationDtype dtype;
  int tokens, key_heads, value_heads, key_dim, value_dim;
  bool normalize_qk, mask;
  bool per_key_gates = false;  // g [T, Hv, Dk]
  // Per-key gates: every other key channel at g = -60 (a decay of 9e-27 a
  // step, not a wipe), beside the others' g in [-1, 0]. A decay factored
  // from the wrong row of a chunk grows past float32 there (exp of +60 per
  // step), and the outputs are not finite.
  bool strong_channels = false;
};

uint16_t to_half_bits(float value) {
  _Float16 half = static_cast<_Float16>(value);
  uint16_t bits;
  std::memcpy(&bits, &half, 2);
  return bits;
}
uint16_t to_bfloat_bits(float value) {
  uint32_t word;
  std::memcpy(&word, &value, 4);
  return uint16_t((word + 0x7fffu + ((word >> 16) & 1u)) >> 16);
}
float from_activation(
    const std::byte* data, size_t index, ActivationDtype dtype) {
  if (dtype == ActivationDtype::Float32) {
    float value;
    std::memcpy(&value, data + 4 * index, 4);
    return value;
  }
  uint16_t bits;
  std::memcpy(&bits, data + 2 * index, 2);
  if (dtype == ActivationDtype::Float16) {
    _Float16 half;
    std::memcpy(&half, &bits, 2);
    return float(half);
  }
  uint32_t word = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &word, 4);
  return value;
}

std::vector<std::byte> activations(
    std::mt19937& rng, size_t count, ActivationDtype dtype, float amplitude) {
  std::uniform_real_distribution<float> uniform(-amplitude, amplitude);
  std::vector<std::byte> out(count * element_bytes(dtype));
  for (size_t i = 0; i < count; ++i) {
    float value = uniform(rng);
    if (dtype == ActivationDtype::Float32) {
      std::memcpy(out.data() + 4 * i, &value, 4);
    } else {
      uint16_t bits = dtype == ActivationDtype::Float16 ? to_half_bits(value)
                                                        : to_bfloat_bits(value);
      std::memcpy(out.data() + 2 * i, &bits, 2);
    }
  }
  return out;
}

std::vector<std::byte> floats(
    std::mt19937& rng, size_t count, float low, float high) {
  std::uniform_real_distribution<float> uniform(low, high);
  std::vector<std::byte> out(count * 4);
  for (size_t i = 0; i < count; ++i) {
    float value = uniform(rng);
    std::memcpy(out.data() + 4 * i, &value, 4);
  }
  return out;
}

void check_finite(
    const char* shape,
    const char* what,
    const std::vector<std::byte>& data,
    size_t count,
    ActivationDtype dtype) {
  for (size_t i = 0; i < count; ++i) {
    if (!std::isfinite(from_activation(data.data(), i, dtype))) {
      throw std::runtime_error(
          std::string(shape) + ": " + what + "[" + std::to_string(i) +
          "] is not finite");
    }
  }
}

void report(
    const char* name, const Plan& plan, std::set<std::string>& kernels_run) {
  for (const Dispatch& d : plan.dispatches)
    kernels_run.insert(d.stage + ": " + d.kernel);
  std::printf("ok  %-52s %zu dispatches\n", name, plan.dispatches.size());
  std::fflush(stdout);
}

void run(const Shape& shape, std::set<std::string>& kernels_run) {
  GatedDeltaParams p;
  p.set_shape(
      {1,
       shape.tokens,
       shape.key_heads,
       shape.value_heads,
       shape.key_dim,
       shape.value_dim});
  p.scale = 1.0f / std::sqrt(float(shape.key_dim));
  p.normalize_qk = shape.normalize_qk;
  p.has_mask = shape.mask;
  p.per_key_gates = shape.per_key_gates;
  Plan plan = make_plan(p, shape.algorithm, shape.dtype);

  std::mt19937 rng(1234);
  const size_t qk = size_t(p.tokens) * p.key_heads * p.key_dim;
  const size_t v = size_t(p.tokens) * p.value_heads * p.value_dim;
  const size_t gates = size_t(p.tokens) * p.value_heads;
  const size_t state = size_t(p.value_heads) * p.value_dim * p.key_dim;
  auto q = activations(rng, qk, shape.dtype, 0.5f);
  auto k = activations(rng, qk, shape.dtype, shape.normalize_qk ? 2.0f : 0.15f);
  auto values = activations(rng, v, shape.dtype, 1.0f);
  auto g = floats(rng, gates * p.gate_width(), -1.0f, 0.0f);
  if (shape.strong_channels) {
    const float strong = -60.0f;
    for (size_t i = 0; i < gates * p.gate_width(); i += 2)
      std::memcpy(&g[i * sizeof(float)], &strong, sizeof(strong));
  }
  auto beta = floats(rng, gates, 0.0f, 1.0f);
  auto state_in = floats(rng, state, -1.0f, 1.0f);
  std::vector<std::byte> mask;
  if (shape.mask) {
    for (int t = 0; t < p.tokens; ++t)
      mask.push_back(std::byte(t % 5 != 2));
  }
  emulator::BufferInputs inputs{
      {PlanBuffer::Query, q},
      {PlanBuffer::Key, k},
      {PlanBuffer::Value, values},
      {PlanBuffer::Gate, g},
      {PlanBuffer::Beta, beta},
      {PlanBuffer::StateIn, state_in}};
  if (shape.mask)
    inputs[PlanBuffer::Mask] = mask;
  emulator::BufferOutputs outputs =
      emulator::run_plan(plan, inputs, std::chrono::seconds(120));
  check_finite(shape.name, "y", outputs.at(PlanBuffer::Output), v, shape.dtype);
  check_finite(
      shape.name,
      "state",
      outputs.at(PlanBuffer::StateOut),
      state,
      ActivationDtype::Float32);
  report(shape.name, plan, kernels_run);
}

struct SegmentShape {
  const char* name;
  Algorithm algorithm;
  ActivationDtype dtype;
  int batch, tokens, key_heads, value_heads, key_dim, value_dim, conv_kernel;
  DecayParameterization decay;
  bool mask;
};

void run_segment(
    const SegmentShape& shape, std::set<std::string>& kernels_run) {
  SegmentParams p;
  p.set_shape(
      {shape.batch,
       shape.tokens,
       shape.key_heads,
       shape.value_heads,
       shape.key_dim,
       shape.value_dim});
  p.conv_kernel = shape.conv_kernel;
  p.decay_parameterization = shape.decay;
  p.has_mask = shape.mask;
  Plan plan = make_segment_plan(p, shape.algorithm, shape.dtype);

  std::mt19937 rng(4321);
  const size_t tokens = size_t(p.batch) * p.tokens;
  const size_t conv_state =
      size_t(p.batch) * p.conv_state_rows() * p.conv_channels();
  const size_t out = tokens * p.v_width();
  const size_t state =
      size_t(p.batch) * p.value_heads * p.value_dim * p.key_dim;
  auto mixed =
      activations(rng, tokens * p.mixed_qkvzba_width(), shape.dtype, 1.0f);
  auto conv_weight =
      floats(rng, size_t(p.conv_channels()) * p.conv_kernel, -0.5f, 0.5f);
  auto decay_parameter = shape.decay == DecayParameterization::LogRate
      ? floats(rng, p.value_heads, -2.0f, 1.0f)
      : floats(rng, p.value_heads, -4.0f, -0.05f);
  auto dt_bias = floats(rng, p.value_heads, -1.0f, 1.0f);
  auto norm_weight = floats(rng, p.value_dim, 0.5f, 1.5f);
  auto conv_state_in = activations(rng, conv_state, shape.dtype, 1.0f);
  auto state_in = floats(rng, state, -1.0f, 1.0f);
  std::vector<std::byte> mask;
  if (shape.mask) {
    for (size_t t = 0; t < tokens; ++t)
      mask.push_back(std::byte(t % 4 != 1));
  }
  emulator::BufferInputs inputs{
      {PlanBuffer::MixedQkvzba, mixed},
      {PlanBuffer::ConvWeight, conv_weight},
      {PlanBuffer::DecayParameter, decay_parameter},
      {PlanBuffer::DtBias, dt_bias},
      {PlanBuffer::NormWeight, norm_weight},
      {PlanBuffer::ConvStateIn, conv_state_in},
      {PlanBuffer::StateIn, state_in}};
  if (shape.mask)
    inputs[PlanBuffer::Mask] = mask;
  emulator::BufferOutputs outputs =
      emulator::run_plan(plan, inputs, std::chrono::seconds(120));
  check_finite(
      shape.name,
      "out",
      outputs.at(PlanBuffer::SegmentOutput),
      out,
      shape.dtype);
  check_finite(
      shape.name,
      "conv_state",
      outputs.at(PlanBuffer::ConvStateOut),
      conv_state,
      shape.dtype);
  check_finite(
      shape.name,
      "state",
      outputs.at(PlanBuffer::StateOut),
      state,
      ActivationDtype::Float32);
  report(shape.name, plan, kernels_run);
}

// The backward plan of a core call: its gradients must all be finite.
// `wipe`: token 70's g is -inf (gamma == 0) in the first value head (its
// first key channel with per-key gates), so that the chunked form sends that
// chunk of that head to the recurrent reverse and the others to its WY
// stages.
struct BackwardShape {
  const char* name;
  ActivationDtype dtype;
  int tokens, key_heads, value_heads, key_dim, value_dim;
  bool normalize_qk, mask, per_key_gates;
  Algorithm algorithm;
  bool wipe;
};

void run_backward(
    const BackwardShape& shape, std::set<std::string>& kernels_run) {
  GatedDeltaParams p;
  p.set_shape(
      {1,
       shape.tokens,
       shape.key_heads,
       shape.value_heads,
       shape.key_dim,
       shape.value_dim});
  p.scale = 1.0f / std::sqrt(float(shape.key_dim));
  p.normalize_qk = shape.normalize_qk;
  p.has_mask = shape.mask;
  p.per_key_gates = shape.per_key_gates;
  Plan plan = make_backward_plan(p, shape.dtype, shape.algorithm);

  std::mt19937 rng(4321);
  const size_t qk = size_t(p.tokens) * p.key_heads * p.key_dim;
  const size_t v = size_t(p.tokens) * p.value_heads * p.value_dim;
  const size_t gates = size_t(p.tokens) * p.value_heads;
  const size_t state = size_t(p.value_heads) * p.value_dim * p.key_dim;
  auto q = activations(rng, qk, shape.dtype, 0.5f);
  auto k = activations(rng, qk, shape.dtype, shape.normalize_qk ? 2.0f : 0.15f);
  auto values = activations(rng, v, shape.dtype, 1.0f);
  auto g = floats(rng, gates * p.gate_width(), -1.0f, 0.0f);
  if (shape.wipe) {
    const float wipe = -std::numeric_limits<float>::infinity();
    std::memcpy(
        &g[70 * p.value_heads * p.gate_width() * sizeof(float)],
        &wipe,
        sizeof(wipe));
  }
  auto beta = floats(rng, gates, 0.0f, 1.0f);
  auto state_in = floats(rng, state, -1.0f, 1.0f);
  auto y_cotangent = activations(rng, v, shape.dtype, 1.0f);
  auto state_cotangent = floats(rng, state, -1.0f, 1.0f);
  std::vector<std::byte> mask;
  if (shape.mask) {
    for (int t = 0; t < p.tokens; ++t)
      mask.push_back(std::byte(t % 5 != 2));
  }
  emulator::BufferInputs inputs{
      {PlanBuffer::Query, q},
      {PlanBuffer::Key, k},
      {PlanBuffer::Value, values},
      {PlanBuffer::Gate, g},
      {PlanBuffer::Beta, beta},
      {PlanBuffer::StateIn, state_in},
      {PlanBuffer::YCotangent, y_cotangent},
      {PlanBuffer::StateCotangent, state_cotangent}};
  if (shape.mask)
    inputs[PlanBuffer::Mask] = mask;
  emulator::BufferOutputs outputs =
      emulator::run_plan(plan, inputs, std::chrono::seconds(120));
  check_finite(
      shape.name, "dq", outputs.at(PlanBuffer::GradQuery), qk, shape.dtype);
  check_finite(
      shape.name, "dk", outputs.at(PlanBuffer::GradKey), qk, shape.dtype);
  check_finite(
      shape.name, "dv", outputs.at(PlanBuffer::GradValue), v, shape.dtype);
  const std::pair<PlanBuffer, size_t> float_outputs[] = {
      {PlanBuffer::GradGate, gates * p.gate_width()},
      {PlanBuffer::GradGamma, gates * p.gate_width()},
      {PlanBuffer::GradBeta, gates},
      {PlanBuffer::GradState, state}};
  for (const auto& [buffer, count] : float_outputs) {
    check_finite(
        shape.name,
        to_string(buffer),
        outputs.at(buffer),
        count,
        ActivationDtype::Float32);
  }
  report(shape.name, plan, kernels_run);
}

}  // namespace

int main() {
  using enum Algorithm;
  using enum ActivationDtype;
  const Shape shapes[] = {
      {"recurrent simd, float32, mask",
       Recurrent,
       Float32,
       5,
       1,
       2,
       32,
       8,
       false,
       true},
      {"recurrent generic, bfloat16, normalize_qk",
       Recurrent,
       BFloat16,
       4,
       1,
       2,
       16,
       8,
       true,
       false},
      {"chunked, float16, normalize_qk, mask",
       Chunked,
       Float16,
       70,
       1,
       2,
       32,
       8,
       true,
       true},
      {"chunked k_gram (Dk 128, repeated heads), float32",
       Chunked,
       Float32,
       65,
       1,
       2,
       128,
       4,
       false,
       false},
      // Per-key gates: a key dim that is not a multiple of the staging width
      // (kKeyDecayTileWidth), and the Dk = 128 shape that runs k_gram for
      // scalar gates (not for per-key ones).
      {"chunked, per-key gates, bfloat16, normalize_qk, mask",
       Chunked,
       BFloat16,
       70,
       1,
       2,
       20,
       8,
       true,
       true,
       true},
      {"chunked, per-key gates (Dk 128, repeated heads), float32",
       Chunked,
       Float32,
       65,
       1,
       2,
       128,
       4,
       false,
       false,
       true},
      // Two chunks whose every sub-chunk factors its decays from its own
      // first row.
      {"chunked, per-key gates, strong channels, float32",
       Chunked,
       Float32,
       128,
       1,
       1,
       16,
       4,
       false,
       false,
       true,
       true},
  };
  // Segment shapes: C = 48 conv channels (threadgroups of 64 threads, so the
  // kernels' channel bounds are exercised); every fourth token masked.
  const SegmentShape segment_shapes[] = {
      {"segment recurrent, float16, log_rate, mask",
       Recurrent,
       Float16,
       2,
       6,
       1,
       2,
       16,
       8,
       4,
       DecayParameterization::LogRate,
       true},
      {"segment chunked, bfloat16, negative_rate",
       Chunked,
       BFloat16,
       1,
       67,
       1,
       2,
       16,
       8,
       3,
       DecayParameterization::NegativeRate,
       false},
  };
  // Backward shapes: two chunks (the second ragged), a key dim that is not a
  // multiple of 32, fewer state rows than SIMD-groups, per-key gates; the
  // chunked (WY) form over three chunks with a wipe in the second, over
  // repeated key heads, and with per-key gates (channel_pairs_backward) and a
  // channel's wipe in the second chunk.
  const BackwardShape backward_shapes[] = {
      {"backward, float16, normalize_qk, mask",
       Float16,
       70,
       1,
       2,
       40,
       5,
       true,
       true,
       false,
       Recurrent,
       false},
      {"backward, bfloat16, per-key gates",
       BFloat16,
       9,
       1,
       2,
       32,
       9,
       false,
       false,
       true,
       Recurrent,
       false},
      {"backward chunked, float32, normalize_qk, mask, a wipe",
       Float32,
       130,
       1,
       2,
       40,
       5,
       true,
       true,
       false,
       Chunked,
       true},
      {"backward chunked, bfloat16, repeated key heads",
       BFloat16,
       65,
       2,
       4,
       32,
       8,
       false,
       false,
       false,
       Chunked,
       false},
      {"backward chunked, float16, per-key gates, normalize_qk, mask, a wipe",
       Float16,
       130,
       1,
       2,
       24,
       6,
       true,
       true,
       true,
       Chunked,
       true},
  };
  std::set<std::string> kernels_run;
  try {
    for (const Shape& shape : shapes)
      run(shape, kernels_run);
    for (const SegmentShape& shape : segment_shapes)
      run_segment(shape, kernels_run);
    for (const BackwardShape& shape : backward_shapes)
      run_backward(shape, kernels_run);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "FAILED: %s\n", error.what());
    return 1;
  }
  std::printf("%zu distinct kernels ran:\n", kernels_run.size());
  for (const std::string& name : kernels_run)
    std::printf("  %s\n", name.c_str());
  return 0;
}
