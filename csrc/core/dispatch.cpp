#include "core/dispatch.h"

namespace mlx_gated_delta {

Algorithm resolve_cpu_algorithm(const GatedDeltaParams& params) {
  // Per-key gates take the same crossover: their grams are matrix products
  // of sub-chunks too (docs/numerics.md, "Per-key-channel gates in the
  // chunked form").
  constexpr int kChunkedMinTokens = 48;
  if (params.has_tree) {
    return Algorithm::Recurrent;  // a tree has no chunks
  }
  return params.tokens < kChunkedMinTokens ? Algorithm::Recurrent
                                           : Algorithm::Chunked;
}

Algorithm resolve_cpu_backward_algorithm(const GatedDeltaParams& params) {
  // Per-key gates take the same crossover: their decayed products run in
  // sub-chunks as matrix products (csrc/cpu/key_chunked_backward.cpp).
  return params.tokens < kChunkedBackwardMinTokens ? Algorithm::Recurrent
                                                   : Algorithm::Chunked;
}

Algorithm resolve_metal_algorithm(const GatedDeltaParams& params) {
  // Trees: the recurrent kernels alone have them (docs/metal.md). Per-key
  // gates take the same crossover: their decayed grams are matrix products
  // of sub-chunks too (key_decayed_grams), and the chunked stages meet the
  // chunked contracts from every entry state (docs/numerics.md,
  // "Per-key-channel gates in the chunked form").
  if (params.has_tree || params.tokens <= int(kChunkSize) ||
      params.key_dim > int(kMaxChunkedKeyDim)) {
    return Algorithm::Recurrent;
  }
  return Algorithm::Chunked;
}

Algorithm resolve_metal_backward_algorithm(const GatedDeltaParams& params) {
  if (params.tokens < kChunkedBackwardMinTokens ||
      params.key_dim > int(kMaxChunkedKeyDim)) {
    return Algorithm::Recurrent;
  }
  return Algorithm::Chunked;
}

bool supports_simd_delta(const GatedDeltaParams& params, int simd_width) {
  return simd_width == 32 && params.key_dim % 32 == 0 && params.key_dim > 0 &&
      params.key_dim <= 128;
}

bool uses_chunk_k_gram_k128(const GatedDeltaParams& params) {
  return params.key_dim == 128 && params.value_heads > params.key_heads;
}

int cpu_value_heads_per_task(const GatedDeltaParams& params, int threads) {
  const int ratio = params.value_heads / params.key_heads;
  const bool group_heads =
      ratio > 1 && params.batch * params.key_heads >= threads;
  return group_heads ? ratio : 1;
}

}  // namespace mlx_gated_delta
