#include "core/core_params.h"

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
      std::string(argument) + " must be one of " + expected.str() + ", got \"" +
      name + "\"");
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

GatedDeltaParams CoreOptions::params(
    const ProblemShape& shape, int checkpoint_count, bool per_key_gates) const {
  GatedDeltaParams p;
  p.set_shape(shape);
  p.scale = scale;
  p.head_mapping = head_mapping;
  p.normalize_qk = normalize_qk;
  p.has_mask = has_mask;
  p.checkpoint_count = checkpoint_count;
  p.has_tree = has_tree;
  p.per_key_gates = per_key_gates;
  return p;
}

GatedDeltaParams shape_params(const ProblemShape& shape) {
  GatedDeltaParams p;
  p.set_shape(shape);
  return p;
}

}  // namespace mlx_gated_delta
