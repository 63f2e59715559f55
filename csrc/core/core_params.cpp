#include "core/core_params.h"

#include "segment/segment_params.h"

#include <limits>
#include <sstream>
#include <stdexcept>

namespace mlx_gated_delta {

namespace {

template <typename Enum, size_t N>
Enum parse_enum(
    const char* argument,
    const std::string& name,
    const std::pair<const char*, Enum> (&choices)[N]) {
  std::ostringstream expected;
  for (size_t i = 0; i < N; ++i) {
    if (name == choices[i].first) {
      return choices[i].second;
    }
    expected << (i ? ", " : "") << '"' << choices[i].first << '"';
  }
  throw std::invalid_argument(
      std::string(argument) + " must be one of " + expected.str() +
      ", got \"" + name + "\"");
}

constexpr std::pair<const char*, HeadMapping> kHeadMappings[] = {
    {"grouped", HeadMapping::Grouped},
    {"interleaved", HeadMapping::Interleaved}};
constexpr std::pair<const char*, Algorithm> kAlgorithms[] = {
    {"auto", Algorithm::Auto},
    {"recurrent", Algorithm::Recurrent},
    {"chunked", Algorithm::Chunked}};
constexpr std::pair<const char*, DecayParameterization>
    kDecayParameterizations[] = {
        {"log_rate", DecayParameterization::LogRate},
        {"negative_rate", DecayParameterization::NegativeRate}};

}  // namespace

HeadMapping parse_head_mapping(const std::string& name) {
  return parse_enum("head_mapping", name, kHeadMappings);
}
Algorithm parse_algorithm(const std::string& name) {
  return parse_enum("algorithm", name, kAlgorithms);
}
DecayParameterization parse_decay_parameterization(const std::string& name) {
  return parse_enum("decay_parameterization", name, kDecayParameterizations);
}

const char* to_string(HeadMapping mapping) {
  return kHeadMappings[static_cast<int>(mapping)].first;
}
const char* to_string(Algorithm algorithm) {
  return kAlgorithms[static_cast<int>(algorithm)].first;
}
const char* to_string(DecayParameterization parameterization) {
  return kDecayParameterizations[static_cast<int>(parameterization)].first;
}

GatedDeltaParams shape_params(int batch, int tokens, int key_heads,
                              int value_heads, int key_dim, int value_dim) {
  GatedDeltaParams p;
  static_cast<ProblemShape&>(p) =
      ProblemShape{batch, tokens, key_heads, value_heads, key_dim, value_dim};
  return p;
}

bool supports_simd_delta(const GatedDeltaParams& params, int simd_width) {
  return simd_width == 32 && params.key_dim % 32 == 0 &&
      params.key_dim > 0 && params.key_dim <= 128;
}

bool uses_chunk_k_gram_k128(const GatedDeltaParams& params) {
  return params.key_dim == 128 && params.value_heads > params.key_heads;
}

Algorithm resolve_cpu_algorithm(const GatedDeltaParams& params) {
  // Measured on the Qwen3-Next shape (README, "Choosing the algorithm"):
  // the chunked form's per-chunk setup (gram, triangular solve, transposes)
  // pays off from about 40 tokens; below, the recurrent form is faster.
  constexpr int kChunkedMinTokens = 48;
  return params.tokens < kChunkedMinTokens ? Algorithm::Recurrent
                                           : Algorithm::Chunked;
}

void check_launch_extent(const char* what, uint64_t elements) {
  constexpr uint64_t kMax = std::numeric_limits<uint32_t>::max();
  if (elements > kMax) {
    std::ostringstream message;
    message << what << " (" << elements
            << ") exceed the 32-bit index range of a GPU kernel (at most "
            << kMax << ")";
    throw std::invalid_argument(message.str());
  }
}

void validate_launch_extents(const GatedDeltaParams& p) {
  const uint64_t b = p.batch, t = p.tokens;
  check_launch_extent(
      "QK activation elements", b * t * uint64_t(p.key_heads) * p.key_dim);
  check_launch_extent(
      "V activation elements", b * t * uint64_t(p.value_heads) * p.value_dim);
  check_launch_extent("gate elements", b * t * uint64_t(p.value_heads));
  check_launch_extent(
      "state elements",
      b * uint64_t(p.value_heads) * p.value_dim * uint64_t(p.key_dim));
}

void validate_plan_shape(const GatedDeltaParams& params) {
  validate_launch_extents(params);
  if (params.key_heads <= 0 || params.value_heads % params.key_heads != 0) {
    throw std::invalid_argument("value_heads must be a multiple of key_heads");
  }
}

void validate_segment_plan_shape(const SegmentParams& sp) {
  if (sp.conv_kernel < 1) {
    throw std::invalid_argument("the conv kernel needs at least one tap, got " +
                                std::to_string(sp.conv_kernel));
  }
  // The segment's own 32-bit extents; validate_plan_shape guards the core's.
  const uint64_t b = sp.batch, t = sp.tokens, channels = sp.conv_channels();
  check_launch_extent("QKV activation elements", b * t * channels);
  check_launch_extent("QKVZBA activation elements", b * t * uint64_t(sp.packed_width()));
  check_launch_extent("conv state elements", b * uint64_t(sp.conv_state_rows()) * channels);
}

}  // namespace mlx_gated_delta
