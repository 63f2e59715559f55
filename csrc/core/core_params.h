// Shapes, parameters, validation and dispatch predicates of the gated-delta ops.
//
// Plain C++ with no backend and no MLX dependency: the CPU kernels, the Metal
// plans, the Metal emulator and the op functions all read the same structs.
#pragma once

#include <cstdint>
#include <string>

namespace mlx_gated_delta {

// Chunk length of the chunked (WY/UT) algorithm, on every backend.
constexpr int kChunkSize = 64;

// Which key head a value head reads (API.md, "Head mappings").
enum class HeadMapping : int {
  Grouped = 0,      // kh = h / (Hv / Hk)
  Interleaved = 1,  // kh = h % Hk
};

enum class Algorithm : int {
  Auto = 0,
  Recurrent = 1,
  Chunked = 2,
};

enum class DecayParameterization : int {
  LogRate = 0,       // decay_parameter is A_log: rate = -exp(A_log)
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
};

// Everything that fixes the result of one core gated-delta call, except the
// data. Layouts (all row-major, contiguous):
//   q, k  [B, T, Hk, Dk]     v, y  [B, T, Hv, Dv]
//   g, beta [B, T, Hv] (float32)   mask [B, T]
//   state [B, Hv, Dv, Dk] (float32)
struct GatedDeltaParams : ProblemShape {
  float scale = 1.0f;
  HeadMapping head_mapping = HeadMapping::Grouped;
  bool normalize_qk = false;
  bool has_mask = false;

  int key_head_of(int value_head) const {
    return head_mapping == HeadMapping::Grouped
        ? value_head / (value_heads / key_heads)
        : value_head % key_heads;
  }
  int num_chunks() const {
    return (tokens + kChunkSize - 1) / kChunkSize;
  }
};

// The params of a shape, with the default options (scale 1, grouped, no
// normalisation, no mask).
GatedDeltaParams shape_params(int batch, int tokens, int key_heads,
                              int value_heads, int key_dim, int value_dim);

// The recurrent kernel with one SIMD-group per state row slice can hold a key
// vector of Dk floats in SIMD lanes only when Dk is a multiple of the SIMD
// width and fits four values per lane.
bool supports_simd_delta(const GatedDeltaParams& params, int simd_width);

// The K K^T gram specialization shares one key head's gram between the value
// heads that read it; it pays only for Dk == 128 with repeated key heads.
bool uses_chunk_k_gram_k128(const GatedDeltaParams& params);

// The algorithm "auto" resolves to on the CPU (README: measured choice).
Algorithm resolve_cpu_algorithm(const GatedDeltaParams& params);

// GPU kernels index with 32-bit unsigned integers: every buffer a kernel reads
// or writes must have fewer than 2^32 elements. Throws std::invalid_argument
// naming the tensor (e.g. "QKV activation elements") otherwise.
void validate_launch_extents(const GatedDeltaParams& params);

// The shape checks every Metal plan makes before it allocates (an op has
// already made its own, with messages that name its arguments): the 32-bit
// extents and a key head for every value head.
void validate_plan_shape(const GatedDeltaParams& params);

// Throws std::invalid_argument with `what` named when `elements` does not fit
// a 32-bit kernel index.
void check_launch_extent(const char* what, uint64_t elements);

}  // namespace mlx_gated_delta
