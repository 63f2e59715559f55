// Shapes and parameters of the core gated-delta op.
//
// Plain C++ with no backend and no MLX dependency: the CPU kernels, the Metal
// plans, the Metal emulator and the op functions all read the same structs.
// The checks on them are in validation/, the choices made from them
// (algorithm, kernel variants) in core/dispatch.h.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

// kChunkSize, the chunk length of the chunked form on every backend, is
// defined once, beside the other constants the kernels and the C++ share.
#include "metal/kernels/kernel_abi.h"

namespace mlx_gated_delta {

// Which key head a value head reads (docs/contract.md).
enum class HeadMapping : int {
  Grouped = 0,  // kh = h / (Hv / Hk)
  Interleaved = 1,  // kh = h % Hk
};

enum class Algorithm : int {
  Auto = 0,
  Recurrent = 1,
  Chunked = 2,
};

enum class DecayParameterization : int {
  LogRate = 0,  // decay_parameter is A_log: rate = -exp(A_log)
  NegativeRate = 1,  // decay_parameter is the (negative) rate itself
};

HeadMapping parse_head_mapping(const std::string& name);
Algorithm parse_algorithm(const std::string& name);
DecayParameterization parse_decay_parameterization(const std::string& name);
const char* to_string(HeadMapping mapping);
const char* to_string(Algorithm algorithm);
const char* to_string(DecayParameterization parameterization);

// The extents of one call, shared by the core's and the segment's params (both
// derive from it, so a shape is copied as one value, never field by field).
struct ProblemShape {
  int batch = 0;
  int tokens = 0;
  int key_heads = 0;
  int value_heads = 0;
  int key_dim = 0;
  int value_dim = 0;

  // Sets the shape part of a params struct derived from this one.
  void set_shape(const ProblemShape& shape) {
    *this = shape;
  }
};

// Everything that fixes the result of one core gated-delta call, except the
// data. Layouts (all row-major, contiguous):
//   q, k  [B, T, Hk, Dk]     v, y  [B, T, Hv, Dv]
//   g [B, T, Hv], or [B, T, Hv, Dk] with per_key_gates (float32)
//   beta [B, T, Hv] (float32)   mask [B, T]
//   state [B, Hv, Dv, Dk] (float32)
//   checkpoints [N] (int32, strictly increasing token counts in [1, T])
//   checkpoint_states [N, B, Hv, Dv, Dk] (float32): the state after each
//   checkpoint's first tokens of the call
struct GatedDeltaParams : ProblemShape {
  float scale = 1.0f;
  HeadMapping head_mapping = HeadMapping::Grouped;
  bool normalize_qk = false;
  bool has_mask = false;
  int checkpoint_count = 0;  // N
  // Tree verification: parents [T] (int32), token t's state follows from
  // token parents[t]'s (-1: the call's initial state); the recurrent form only.
  bool has_tree = false;
  // g holds one decay per key channel (Kimi Delta Attention): the state's
  // column c decays by exp(g[t, h, c]) (docs/contract.md).
  bool per_key_gates = false;

  // g's elements per value head of one token: 1, or Dk with per-key gates.
  int gate_width() const {
    return per_key_gates ? key_dim : 1;
  }

  int key_head_of(int value_head) const {
    return head_mapping == HeadMapping::Grouped
        ? value_head / (value_heads / key_heads)
        : value_head % key_heads;
  }
  // The n-th value head that reads key head `key_head` (key_head_of's
  // inverse): consecutive ones in the grouped mapping, every Hk-th one in the
  // interleaved mapping.
  int value_head_of(int key_head, int n) const {
    return head_mapping == HeadMapping::Grouped
        ? key_head * (value_heads / key_heads) + n
        : key_head + n * key_heads;
  }
  int num_chunks() const {
    return (tokens + int(kChunkSize) - 1) / int(kChunkSize);
  }
};

// The options of one core call that fix its result apart from its shape and
// its data, as the op function read them: what the primitives carry (and
// compare whole in is_equivalent). `algorithm` is the one requested, Auto
// included; eval_cpu and the Metal plan resolve Auto per shape.
struct CoreOptions {
  float scale = 1.0f;
  HeadMapping head_mapping = HeadMapping::Grouped;
  bool normalize_qk = false;
  bool has_mask = false;
  Algorithm algorithm = Algorithm::Auto;
  bool has_checkpoints = false;
  bool has_tree = false;
  // The linear decay gamma of which g = log(gamma) was taken follows the
  // other inputs (core_primitive.h).
  bool has_gamma = false;

  bool operator==(const CoreOptions&) const = default;

  // The params of a call with these options over `shape`, with
  // `checkpoint_count` checkpoints and g per key channel or not.
  GatedDeltaParams params(
      const ProblemShape& shape,
      int checkpoint_count,
      bool per_key_gates) const;
};

// The readout scale when the caller gives none: Dk ** -0.5, in float32.
inline float default_scale(int key_dim) {
  return 1.0f / std::sqrt(static_cast<float>(key_dim));
}

// The params of a shape, with the default options (scale 1, grouped, no
// normalisation, no mask).
GatedDeltaParams shape_params(const ProblemShape& shape);

}  // namespace mlx_gated_delta
