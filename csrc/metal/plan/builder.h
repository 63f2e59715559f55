// The primitives the plan builders share (forward.cpp, segment.cpp,
// backward.cpp): the core call's buffers, adding a dispatch, and the forward's
// stages, which the segment runs between its own and the chunked backward
// runs before its own. Internal to the plan library: executors read plan.h.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "metal/plan/plan.h"

namespace mlx_gated_delta::metal {

// The unit of the threadgroup memory sizes that each stage's builder
// declares for its kernel (the kernels' `threadgroup` arrays, sized by the
// layout constants of kernel_abi.h).
constexpr size_t kFloat = sizeof(float);
constexpr size_t kChunkTileBytes = kChunkSize * kChunkSize * kFloat;

inline unsigned ceil_div(uint64_t a, uint64_t b) {
  return unsigned((a + b - 1) / b);
}

// The host name of a kernel instantiation: gated_delta_<stage>_<dtype>.
std::string kernel_name(const char* stage, ActivationDtype dtype);

// The six shape fields every scalar block starts with.
template <typename KernelParams>
void set_kernel_shape(KernelParams& k, const ProblemShape& shape) {
  k.batch = shape.batch;
  k.tokens = shape.tokens;
  k.key_heads = shape.key_heads;
  k.value_heads = shape.value_heads;
  k.key_dim = shape.key_dim;
  k.value_dim = shape.value_dim;
}

// Builds a plan one stage at a time: the constructor binds the core call's
// inputs and outputs, each stage method adds its dispatch (and, for the
// chunked stages, chunked_scratch() their scratch first). The segment and
// backward builders derive from it and add their buffers and stages around
// the core's.
struct PlanBuilder {
  const GatedDeltaParams& p;
  Plan plan;
  ActivationDtype core_dtype;  // of q, k, v, y: float32 inside a segment
  uint64_t B, T, Hk, Hv, Dk, Dv, C, padded_tokens, e;

  PlanBuilder(
      const GatedDeltaParams& params,
      Algorithm algorithm,
      ActivationDtype dtype);

  // The in-chunk decays of one (batch, value head) for `width` gate columns,
  // in bytes: the cumulative log decays (4 a row) and the wipe masks (8 a
  // chunk) that gate_cumsum writes and the later stages read.
  double decay_bytes_per_head(double width) const {
    return (padded_tokens * 4.0 + C * 8.0) * width;
  }

  void add_buffer(PlanBuffer buffer, uint64_t bytes, BufferRole role) {
    plan.buffers.push_back({buffer, bytes, role});
  }
  // Scratch is indexed by the kernels with 32-bit integers too.
  void add_scratch(
      PlanBuffer buffer,
      const char* what,
      uint64_t elements,
      uint64_t bytes_each);

  // A buffer the call does not have (no mask, no tokens) stays unbound: the
  // kernel reads it only under the flag or the extent that says it exists.
  Dispatch& add(
      const char* stage,
      std::string kernel,
      Grid3 groups,
      unsigned threads,
      size_t threadgroup_bytes,
      const std::vector<std::pair<unsigned, PlanBuffer>>& bindings,
      unsigned params_index,
      const std::vector<PlanBuffer>& writes);

  std::string core_kernel(const char* stage) const {
    return kernel_name(stage, core_dtype);
  }
  bool chunked() const {
    return plan.algorithm == Algorithm::Chunked;
  }
  // Per-key gates decay the gram per channel inside the sum: no shared K K^T.
  bool uses_k_gram() const {
    return uses_chunk_k_gram_k128(p) && !p.per_key_gates;
  }
  // Per-key gates: chunk_qk's tiles are per value head (decayed per channel).
  uint64_t qk_heads() const {
    return p.per_key_gates ? Hv : Hk;
  }
  double tile() const {
    return double(kChunkSize) * kChunkSize;
  }
  uint64_t chunk_tiles() const {
    return C * kChunkSize * kChunkSize;
  }

  // The forward's stages (forward.cpp). core() runs them all in order;
  // chunked_through_carry() the chunked form's up to chunk_carry, whose
  // T, W and V' the chunked backward reads.
  void core();
  void chunked_through_carry();
  void chunked_scratch();  // the chunked stages' scratch (none if recurrent)
  void recurrent();
  void qk_norm();
  void gate_cumsum();
  void k_gram();
  void kkt_inverse();
  void recompute_w_u();
  void chunk_qk();
  void chunk_carry();
  void chunk_output();

  // No tokens (T == 0, chunked): the per-chunk stages have empty grids and
  // are left out; the carry still copies the state. Validates the plan.
  Plan finish();
};

}  // namespace mlx_gated_delta::metal
