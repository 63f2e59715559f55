// Metal dispatch plans: from the shape and the algorithm, the ordered list of
// dispatches (kernel, buffer bindings, scalar params, grid, threadgroup size,
// threadgroup memory) that computes one core gated-delta call, one fused
// segment call or one core backward.
//
// Plain C++ compiled on every platform, and data only: the Metal executor
// (macOS) encodes a plan on MLX's command encoder, the emulator (Linux tests)
// runs the same plan over the same .metal sources on the CPU, and nothing
// here names a backend's types, so another executor can run them too.
//
// This header holds the plan's types, Metal's limits and the entry points;
// builder.h the primitives the builders share, forward.cpp, segment.cpp and
// backward.cpp the three builders, validate.cpp and describe.cpp the checks
// against the limits and the cost model.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/core_params.h"
#include "core/dispatch.h"
#include "metal/kernels/kernel_abi.h"
#include "segment/segment_params.h"

namespace mlx_gated_delta::metal {

// Metal's limits on Apple GPUs: validate_plan holds every plan to them, and
// the emulator refuses a dispatch over them, so that a plan that would fail
// on a Mac fails on Linux too.
constexpr unsigned kMaxThreadsPerThreadgroup = 1024;
constexpr size_t kMaxThreadgroupMemoryBytes = 32 * 1024;
constexpr unsigned kMaxBufferIndex = 30;

enum class ActivationDtype : int { Float32 = 0, Float16 = 1, BFloat16 = 2 };
const char* to_string(ActivationDtype dtype);
size_t element_bytes(ActivationDtype dtype);

// Every buffer a plan can bind: the core call's inputs and outputs, the
// scratch buffers of the chunked stages (float32 unless noted), then the
// fused segment's own. In a segment plan, q, k, v, g, beta and y are scratch
// between the segment's stages and the core's (float32).
enum class PlanBuffer : int {
  Query,
  Key,
  Value,
  Gate,
  Beta,
  Mask,
  StateIn,
  Output,
  StateOut,
  QueryInverseNorm,  // [B, T, Hk]   1 / |q| when normalize_qk
  KeyInverseNorm,  // [B, T, Hk]
  GateCumsum,  // [B, Hv, C*64] inclusive cumsum of finite g in a chunk
  WipeMask,  // [B, Hv, C] uint64: bit i set where step i's decay is 0 (a wipe)
  BetaEffective,  // [B, Hv, C*64] beta, 0 on masked tokens
  KGram,  // [B, Hk, C, 64, 64] k_i . k_j
  KktInverse,  // [B, Hv, C, 64, 64] (I + A)^-1
  W,  // [B, Hv, C*64, Dk]
  U,  // [B, Hv, C*64, Dv] U, then v' = U - W S^T (chunk_carry)
  QK,  // [B, Hk, C, 64, 64] q_i . k_j
  OutputInter,  // [B, Hv, C*64, Dv] scale * decay * S_chunk_entry q_i
  MixedQkvzba,  // [B, T, F] packed [q | k | v | z | b | a], activation dtype
  ConvWeight,  // [C, K]
  DecayParameter,  // [Hv]
  DtBias,  // [Hv]
  NormWeight,  // [Dv]
  ConvStateIn,  // [B, K-1, C] activation dtype
  SegmentOutput,  // [B, T, Hv, Dv] activation dtype
  ConvStateOut,  // [B, K-1, C] activation dtype
  Checkpoints,  // [N] int32 token counts (only with checkpoints)
  CheckpointStates,  // [N, B, Hv, Dv, Dk] the state after each checkpoint
  ConvCheckpointStates,  // [N, B, K-1, C] activation dtype (segment)
  Parents,  // [T] int32 (tree verification only)
  TreeStates,  // [B, Hv, T, Dv, Dk] every token's state (tree verification)
  // The backward plan (make_backward_plan): the cotangents it takes, the
  // gradients it returns (in the shapes of their inputs; dq, dk, dv in the
  // activation dtype, the rest float32), and its scratch.
  YCotangent,  // [B, T, Hv, Dv] activation dtype
  StateCotangent,  // [B, Hv, Dv, Dk] of the final state
  GradQuery,  // [B, T, Hk, Dk]
  GradKey,  // [B, T, Hk, Dk]
  GradValue,  // [B, T, Hv, Dv]
  GradGate,  // the shape of g
  GradGamma,  // the shape of g: wrt the linear decay exp(g)
  GradBeta,  // [B, T, Hv]
  GradState,  // [B, Hv, Dv, Dk], also the carried dS while chunks are walked
  BoundaryStates,  // [B, Hv, C, Dv, Dk] the state entering each chunk
  ChunkStates,  // [B, Hv, 64, Dv, Dk] the states inside the chunk at hand
  QueryHeadGrad,  // [B, T, Hv, Dk] dq per value head, before qk_grad_reduce
  KeyHeadGrad,  // [B, T, Hv, Dk]
  // The chunked (WY) backward's own scratch, beside the forward's chunked
  // scratch (U holds V', chunk_carry's deltas).
  CorrectedGrad,  // [B, Hv, C*64, Dv] dV' (= dU)
  WGrad,  // [B, Hv, C*64, Dk] dW
  KktInverseGrad,  // [B, Hv, C, 64, 64] dT
  // The gradients of the decays without them, which gate_cumsum_backward
  // scans into dgamma: of decay(i, -1) (entry terms) and of decay(i, j),
  // j < i (pair terms; the exit state's decay(L-1, j) in row L-1).
  DecayEntryTerms,  // [B, Hv, C*64]; per-key gates [B, Hv, C*64, Dk]
  DecayPairTerms,  // [B, Hv, C, 64, 64]; scalar gates only
  // Per-key gates, for channel_pairs_backward, which forms the pair terms
  // per channel from the scalar tiles dM and dA: the exit state's
  // decay(L-1, j, c) terms, and the tiles.
  DecayExitTerms,  // [B, Hv, C*64, Dk]
  QKGrad,  // [B, Hv, C, 64, 64] dM, the gradient of chunk_qk's decayed tile
  KktGrad,  // [B, Hv, C, 64, 64] dA, of A = diag(beta) (K K^T decayed)
  // [B, Hv, C] uint64 per gate channel: bit i set where step i's decay is
  // below float32's smallest normal number (a wipe included); the chunk test
  // of every stage (chunk_decays_normal), written by the rerun's gate_cumsum.
  TinyDecayMask,
  Count,
};
const char* to_string(PlanBuffer buffer);

// What a buffer is to the call: executors fill inputs from the caller, hand
// outputs back, and allocate scratch; no dispatch may write an input.
enum class BufferRole : int { Input, Output, Scratch };

struct BufferSpec {
  PlanBuffer buffer;
  uint64_t bytes;
  BufferRole role;
};

// The scalar block a dispatch gets at its params_index.
enum class KernelParamsBlock : int { Core, Segment };

struct Grid3 {
  unsigned x = 1, y = 1, z = 1;
  uint64_t count() const {
    return uint64_t(x) * y * z;
  }
};

struct Binding {
  unsigned index;  // [[buffer(index)]]
  PlanBuffer buffer;
  bool written;  // the kernel writes it (an executor orders later reads after
                 // it)
};

// A stage the host runs once per chunk (the backward walks its chunks from
// the last to the first, one dispatch each) reads which chunk from a second
// scalar, set with setBytes at `index`.
struct ChunkScalar {
  unsigned index;  // [[buffer(n)]]
  uint32_t chunk;
};

struct Dispatch {
  std::string stage;  // the math's name: recurrent, k_gram, kkt_inverse, ...
  std::string kernel;  // host name of the kernel instantiation
  std::vector<Binding> buffers;
  unsigned params_index = 0;  // [[buffer(n)]] of the scalar params' bytes
  KernelParamsBlock params_block = KernelParamsBlock::Core;
  std::optional<ChunkScalar> chunk;  // per-chunk stages only
  Grid3 threadgroups;
  Grid3 threads_per_threadgroup;
  size_t threadgroup_memory_bytes = 0;  // what the kernel declares, statically
  double bytes_moved = 0;  // device memory read + written
  double flops = 0;
};

struct Plan {
  Algorithm algorithm = Algorithm::Recurrent;  // resolved, never Auto
  bool backward = false;  // make_backward_plan's
  ActivationDtype dtype = ActivationDtype::Float32;
  GatedDeltaKernelParams kernel_params{};
  SegmentKernelParams segment_params{};  // segment plans only
  std::vector<BufferSpec> buffers;  // every buffer bound, inputs included
  std::vector<Dispatch> dispatches;

  uint64_t buffer_bytes(PlanBuffer buffer) const;
  const BufferSpec* find_buffer(PlanBuffer buffer) const;
  // The bytes of the scalar block a dispatch binds at its params_index.
  const void* params_data(const Dispatch& dispatch) const;
  size_t params_size(const Dispatch& dispatch) const;
};

// Throws std::invalid_argument for shapes no plan covers (and, through
// validate_plan_shape, for 32-bit index overflow). "auto" resolves through
// resolve_metal_algorithm (core/dispatch.h).
Plan make_plan(
    const GatedDeltaParams& params, Algorithm algorithm, ActivationDtype dtype);

// The fused layer segment (docs/contract.md): prepare_conv (conv + SiLU into
// float32 q, k, v), prepare_gates, collect_conv_state, then the core plan of
// SegmentParams::core_params() (normalize_qk on) over those float32
// buffers, then gated_norm. `dtype` is the activation dtype of mixed, the
// conv state and out.
Plan make_segment_plan(
    const SegmentParams& params, Algorithm algorithm, ActivationDtype dtype);

// The backward (vjp) of one core call (docs/metal.md, backward). `algorithm`
// as the forward's ("auto" resolves through resolve_metal_backward_algorithm,
// core/dispatch.h). plan.algorithm is the form the gradient is taken in:
// - Recurrent, as the CPU's recurrent reverse: boundary_states, then for
//   every chunk from the last to the first chunk_states and
//   recurrent_chunk_backward (one dispatch each, the chunk in the dispatch's
//   ChunkScalar), then qk_grad_reduce.
// - Chunked (WY): the forward's chunked stages through chunk_carry (T, W, V'),
//   boundary_states, chunk_output_backward over all chunks, per chunk from the
//   last chunk_states, recurrent_chunk_backward (both only on chunks with a
//   decay that is not a normal float, a wipe) and chunk_carry_backward (the
//   others), then recompute_w_u_backward, kkt_inverse_backward,
//   gate_cumsum_backward (per-key gates: channel_pairs_backward) over all
//   chunks, and qk_grad_reduce.
// Inputs: q, k, v, g, beta, state_in [, mask], y_cotangent, state_cotangent;
// outputs dq, dk, dv, dg, dgamma, dbeta, dstate. Key dims up to
// kMaxBackwardKeyDim; no checkpoints or trees.
Plan make_backward_plan(
    const GatedDeltaParams& params,
    ActivationDtype dtype,
    Algorithm algorithm = Algorithm::Auto);

// Metal's limits (threads per threadgroup, threadgroup memory, buffer
// indices); make_plan calls it, and so does every executor.
void validate_plan(const Plan& plan);

// The chip a plan is compared against, on paper.
struct Roofline {
  std::string chip;
  double bytes_per_second;
  double flops_per_second;
};
Roofline assumed_m_series_roofline();
std::string describe_plan(const Plan& plan, const Roofline& roofline);

}  // namespace mlx_gated_delta::metal
