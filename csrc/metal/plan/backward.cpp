// The backward's plan (plan.h, make_backward_plan): the recurrent reverse of
// every chunk, or the chunked (WY) backward over the forward's chunked stages
// (builder.h) through chunk_carry.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "metal/plan/builder.h"
#include "validation/extents.h"

namespace mlx_gated_delta::metal {

namespace {

// Threadgroup memory each backward kernel declares (kernel_abi.h's layout
// constants).
constexpr size_t kRecurrentChunkBackwardBytes =
    (3 * kBackwardSimdGroups * kMaxBackwardKeyDim + 2 * kBackwardSimdGroups) *
    kFloat;
// The chunked backward's WY stages: a 64 x 64 tile (chunk_output_backward),
// three partial sums per thread (chunk_carry_backward), the T tile and two
// partial sums per thread (recompute_w_u_backward), T and X = dT T^T
// (kkt_inverse_backward), the pair terms' tile and the chunk's gammas
// (gate_cumsum_backward); channel_pairs_backward keeps its channel's sums
// in registers and declares none.
constexpr size_t kChunkOutputBackwardBytes = kChunkTileBytes;
constexpr size_t kChunkCarryBackwardBytes = 3 * kChunkThreads * kFloat;
constexpr size_t kRecomputeWuBackwardBytes =
    kChunkTileBytes + 2 * kChunkThreads * kFloat;
constexpr size_t kKktInverseBackwardBytes = 2 * kChunkTileBytes;
constexpr size_t kGateCumsumBackwardBytes =
    kChunkTileBytes + kChunkSize * kFloat;
static_assert(kChunkThreads % kChunkSize == 0);
static_assert((kChunkSize * kChunkSize) % kChunkThreads == 0);
// Per-key gates: chunk_carry_backward and channel_pairs_backward give key
// channel c to thread c of their threadgroup.
static_assert(kMaxChunkedKeyDim <= kChunkThreads);
// recurrent_chunk_backward: thread tid adds up the partial sums of key column
// tid.
static_assert(kBackwardThreads == kMaxBackwardKeyDim);
static_assert(kBackwardColumnsPerLane * 32 == kMaxBackwardKeyDim);

// The backward's stages (docs/metal.md, backward) over the forward's inputs:
// the forward's outputs are not bound, the cotangents, gradients and the
// backward's scratch are.
struct BackwardPlanBuilder : PlanBuilder {
  unsigned row_groups;

  BackwardPlanBuilder(
      const GatedDeltaParams& params,
      ActivationDtype dtype,
      Algorithm algorithm)
      : PlanBuilder(params, algorithm, dtype) {
    using enum PlanBuffer;
    constexpr BufferRole input = BufferRole::Input, output = BufferRole::Output;
    plan.backward = true;
    std::erase_if(plan.buffers, [](const BufferSpec& spec) {
      return spec.buffer == Output || spec.buffer == StateOut;
    });
    const uint64_t gates = B * T * Hv * uint64_t(p.gate_width());
    const uint64_t state = B * Hv * Dv * Dk;
    add_buffer(YCotangent, B * T * Hv * Dv * e, input);
    add_buffer(StateCotangent, state * 4, input);
    add_buffer(GradQuery, B * T * Hk * Dk * e, output);
    add_buffer(GradKey, B * T * Hk * Dk * e, output);
    add_buffer(GradValue, B * T * Hv * Dv * e, output);
    add_buffer(GradGate, gates * 4, output);
    add_buffer(GradGamma, gates * 4, output);
    add_buffer(GradBeta, B * T * Hv * 4, output);
    add_buffer(GradState, state * 4, output);
    add_scratch(BoundaryStates, "boundary state elements", C * state, 4);
    add_scratch(
        ChunkStates, "chunk state elements", C > 0 ? kChunkSize * state : 0, 4);
    add_scratch(
        QueryHeadGrad, "per-head gradient elements", B * T * Hv * Dk, 4);
    add_scratch(KeyHeadGrad, "per-head gradient elements", B * T * Hv * Dk, 4);
    row_groups = ceil_div(Dv, kBackwardRows);
    if (plan.algorithm == Algorithm::Chunked) {
      // The forward's chunked stages write the state after the call too
      // (chunk_carry); the backward does not need it.
      chunked_scratch();
      add_scratch(StateOut, "state elements", state, 4);
      add_scratch(
          CorrectedGrad, "dV' elements", B * Hv * padded_tokens * Dv, 4);
      add_scratch(WGrad, "dW elements", B * Hv * padded_tokens * Dk, 4);
      add_scratch(KktInverseGrad, "dT elements", B * Hv * chunk_tiles(), 4);
      // The decays' gradients: scalar gates' entry and pair terms; per-key
      // gates' entry and exit terms per channel and the tiles dM and dA
      // that channel_pairs_backward forms the pair terms from.
      const uint64_t width = p.gate_width();
      add_scratch(
          DecayEntryTerms,
          "entry term elements",
          B * Hv * padded_tokens * width,
          4);
      if (p.per_key_gates) {
        add_scratch(
            DecayExitTerms,
            "exit term elements",
            B * Hv * padded_tokens * width,
            4);
        add_scratch(QKGrad, "dM elements", B * Hv * chunk_tiles(), 4);
        add_scratch(KktGrad, "dA elements", B * Hv * chunk_tiles(), 4);
      } else {
        add_scratch(
            DecayPairTerms, "pair term elements", B * Hv * chunk_tiles(), 4);
      }
      add_scratch(
          TinyDecayMask,
          "tiny decay mask elements",
          B * Hv * padded_tokens / kChunkSize * width,
          8);
      plan.kernel_params.recurrent_wipe_chunks_only = 1;
    }
  }

  // Bytes the chunk test (chunk_decays_normal) reads, once per value head:
  // the tiny-decay mask's word per chunk and gate channel.
  double chunk_test_bytes(double tokens) const {
    return B * Hv * std::ceil(tokens / kChunkSize) * p.gate_width() * 8.0;
  }

  // Bytes of the token mask, read once per value head by the stages that
  // skip masked rows.
  double token_mask_bytes(double tokens) const {
    return B * Hv * tokens * (p.has_mask ? 1 : 0);
  }

  // Bytes of one token's gates: g (one per head or per key channel) and beta.
  double gate_bytes() const {
    return (p.gate_width() + 1) * 4.0;
  }

  void boundary_states() {
    using enum PlanBuffer;
    Dispatch& d =
        add("boundary_states",
            core_kernel("boundary_states"),
            {row_groups, unsigned(Hv), unsigned(B)},
            kBackwardRows * 32,
            0,
            {{0, Key},
             {1, Value},
             {2, Gate},
             {3, Beta},
             {4, Mask},
             {5, StateIn},
             {6, StateCotangent},
             {7, BoundaryStates},
             {8, GradState}},
            9,
            {BoundaryStates, GradState});
    // The tokens before the last chunk (the state leaving it is not needed);
    // each row-group of a head reads the same k (caches serve the repeats:
    // counted once per head). The state in, the cotangent copied to dstate,
    // and every boundary state written.
    const double tokens = double(C > 0 ? (C - 1) * kChunkSize : 0);
    d.bytes_moved = B * Hv *
        (tokens * ((Dk + Dv) * double(e) + gate_bytes()) +
         (3.0 + C) * Dv * Dk * 4);
    // Per token and row: decay, prediction and update over Dk columns.
    d.flops = 5.0 * B * Hv * tokens * Dk * Dv;
  }

  void chunk_states(uint32_t chunk) {
    using enum PlanBuffer;
    Dispatch& d =
        add("chunk_states",
            core_kernel("chunk_states"),
            {row_groups, unsigned(Hv), unsigned(B)},
            kBackwardRows * 32,
            0,
            {{0, Key},
             {1, Value},
             {2, Gate},
             {3, Beta},
             {4, Mask},
             {5, BoundaryStates},
             {6, ChunkStates},
             {9, TinyDecayMask}},
            7,
            {ChunkStates});
    d.chunk = ChunkScalar{8, chunk};
    const double length = double(
        std::min<uint64_t>(kChunkSize, T - uint64_t(chunk) * kChunkSize));
    if (chunked()) {
      // Counted as a chunk without a wipe (the WY stages take it): the test.
      d.bytes_moved = Dv * chunk_test_bytes(length) / kBackwardRows;
      return;
    }
    d.bytes_moved = B * Hv *
        (length * ((Dk + Dv) * double(e) + gate_bytes()) +
         (1.0 + length) * Dv * Dk * 4);
    d.flops = 5.0 * B * Hv * (length - 1) * Dk * Dv;
  }

  void recurrent_chunk_backward(uint32_t chunk) {
    using enum PlanBuffer;
    Dispatch& d =
        add("recurrent_chunk_backward",
            core_kernel("recurrent_chunk_backward"),
            {unsigned(Hv), unsigned(B), 1},
            kBackwardThreads,
            kRecurrentChunkBackwardBytes,
            {{0, Query},
             {1, Key},
             {2, Value},
             {3, Gate},
             {4, Beta},
             {5, Mask},
             {6, YCotangent},
             {7, ChunkStates},
             {8, GradState},
             {9, QueryHeadGrad},
             {10, KeyHeadGrad},
             {11, GradValue},
             {12, GradGate},
             {13, GradGamma},
             {14, GradBeta},
             {17, TinyDecayMask}},
            15,
            {GradState,
             QueryHeadGrad,
             KeyHeadGrad,
             GradValue,
             GradGate,
             GradGamma,
             GradBeta});
    d.chunk = ChunkScalar{16, chunk};
    const double length = double(
        std::min<uint64_t>(kChunkSize, T - uint64_t(chunk) * kChunkSize));
    if (chunked()) {
      d.bytes_moved = chunk_test_bytes(length);
      return;
    }
    // Per token: the state before it read once, dS read and written once (a
    // row's second pass is served by caches), q, k, v, dy and the gates read,
    // dv, the per-head dq and dk and the gates' gradients written.
    d.bytes_moved = B * Hv * length *
        (3.0 * Dv * Dk * 4 + (2 * Dk + 3 * Dv) * double(e) + gate_bytes() +
         2 * Dk * 4.0 + (2 * p.gate_width() + 1) * 4.0);
    // Per token, row and column: 7 flops in the first pass, 13 in the second.
    d.flops = 20.0 * B * Hv * length * Dk * Dv;
  }

  void qk_grad_reduce() {
    using enum PlanBuffer;
    const uint64_t rows = B * T * Hk;
    Dispatch& d =
        add("qk_grad_reduce",
            core_kernel("qk_grad_reduce"),
            {ceil_div(rows, kGradReduceRowsPerThreadgroup), 1, 1},
            kGradReduceRowsPerThreadgroup * 32,
            0,
            {{0, Query},
             {1, Key},
             {2, QueryHeadGrad},
             {3, KeyHeadGrad},
             {4, GradQuery},
             {5, GradKey}},
            6,
            {GradQuery, GradKey});
    // The per-value-head gradients read once, q and k read and dq, dk written.
    d.bytes_moved = 2.0 * B * T * (Hv * Dk * 4.0 + 2 * Hk * Dk * double(e));
    d.flops = 2.0 * B * T * (Hv * Dk + (p.normalize_qk ? 8.0 * Hk * Dk : 0.0));
  }

  // The chunked backward's WY stages (docs/numerics.md, "The chunked
  // backward"). Each counts its products at their sizes on paper and its
  // device traffic once (the repeats inside a threadgroup from caches).

  void chunk_output_backward() {
    using enum PlanBuffer;
    const bool per_key = p.per_key_gates;
    Dispatch& d = add(
        "chunk_output_backward",
        core_kernel("chunk_output_backward"),
        {unsigned(C), unsigned(Hv), unsigned(B)},
        kChunkThreads,
        kChunkOutputBackwardBytes,
        {{0, Query},
         {1, Key},
         {2, TinyDecayMask},
         {3, Mask},
         {4, QueryInverseNorm},
         {5, KeyInverseNorm},
         {6, GateCumsum},
         {7, QK},
         {8, U},
         {9, YCotangent},
         {10, CorrectedGrad},
         {11, DecayPairTerms},
         {12, QueryHeadGrad},
         {13, KeyHeadGrad},
         {15, QKGrad}},
        14,
        {CorrectedGrad, DecayPairTerms, QueryHeadGrad, KeyHeadGrad, QKGrad});
    // dy, q, k and V' read, Q K^T per value head; dV', dq, dk and the pair
    // terms written. Per-key gates: the tile is the value head's (chunk_qk
    // decayed it), dM is written whole, and dq and dk are started at 0
    // (channel_pairs_backward forms their products).
    d.bytes_moved = chunk_test_bytes(double(T)) + token_mask_bytes(double(T)) +
        B * Hv *
            (T * (Dv + 2 * Dk) * double(e) + 2 * chunk_tiles() * 4.0 +
             padded_tokens * (2 * Dv + 2 * Dk + 1) * 4.0);
    // dM, dV', dq and dk: four triangular 64 x 64 products per chunk (per-key
    // gates: dM and dV').
    d.flops = 2.0 * B * Hv * C * tile() * (Dv + (per_key ? 0 : Dk));
  }

  void chunk_carry_backward(uint32_t chunk) {
    using enum PlanBuffer;
    Dispatch& d =
        add("chunk_carry_backward",
            core_kernel("chunk_carry_backward"),
            {unsigned(Hv), unsigned(B), 1},
            kChunkThreads,
            kChunkCarryBackwardBytes,
            {{0, Query},
             {1, Key},
             {2, TinyDecayMask},
             {3, Mask},
             {4, QueryInverseNorm},
             {5, KeyInverseNorm},
             {6, GateCumsum},
             {7, W},
             {8, U},
             {9, BoundaryStates},
             {10, YCotangent},
             {11, GradState},
             {12, CorrectedGrad},
             {13, WGrad},
             {14, DecayEntryTerms},
             {15, DecayPairTerms},
             {16, QueryHeadGrad},
             {17, KeyHeadGrad},
             {20, DecayExitTerms}},
            18,
            {GradState,
             CorrectedGrad,
             WGrad,
             DecayEntryTerms,
             DecayPairTerms,
             QueryHeadGrad,
             KeyHeadGrad,
             DecayExitTerms});
    d.chunk = ChunkScalar{19, chunk};
    const double length = double(
        std::min<uint64_t>(kChunkSize, T - uint64_t(chunk) * kChunkSize));
    // dS read and written, S0 read; per token dy, q, k, V', W read, dV' read
    // and written, dW written, dq and dk read and written; per-key gates,
    // the channels' log decays read and the entry and exit terms written
    // per channel.
    d.bytes_moved = chunk_test_bytes(length) + token_mask_bytes(length) +
        B * Hv *
            (3.0 * Dv * Dk * 4 + length * (Dv + 2 * Dk) * double(e) +
             length * (3 * Dv + 6 * Dk) * 4.0 +
             (p.per_key_gates ? length * 3 * Dk * 4.0 : 0.0));
    // Six [L, Dv] x [Dv, Dk]-sized products: dS k, S0^T dO, dS^T V', dW, and
    // dS0's two sums.
    d.flops = 12.0 * B * Hv * length * Dv * Dk;
  }

  void recompute_w_u_backward() {
    using enum PlanBuffer;
    Dispatch& d = add(
        "recompute_w_u_backward",
        core_kernel("recompute_w_u_backward"),
        {unsigned(C), unsigned(Hv), unsigned(B)},
        kChunkThreads,
        kRecomputeWuBackwardBytes,
        {{0, Key},
         {1, Value},
         {2, TinyDecayMask},
         {4, KeyInverseNorm},
         {5, GateCumsum},
         {6, BetaEffective},
         {7, KktInverse},
         {8, CorrectedGrad},
         {9, WGrad},
         {10, KktInverseGrad},
         {11, DecayEntryTerms},
         {12, KeyHeadGrad},
         {13, GradValue},
         {14, GradBeta}},
        15,
        {KktInverseGrad, DecayEntryTerms, KeyHeadGrad, GradValue, GradBeta});
    // T read and dT written; dV', dW, v and k read; dv written, dk read and
    // written, dbeta and the entry terms; per-key gates, the channels' log
    // decays read and the entry terms read and written per channel.
    d.bytes_moved = chunk_test_bytes(double(T)) +
        B * Hv *
            (2 * chunk_tiles() * 4.0 + padded_tokens * (Dv + 3 * Dk + 4) * 4.0 +
             T * (2 * Dv + Dk) * double(e) +
             (p.per_key_gates ? padded_tokens * 3 * Dk * 4.0 : 0.0));
    // dT (two triangular products) and T^T dU, T^T dW.
    d.flops = 2.0 * B * Hv * C * tile() * (Dv + Dk);
  }

  void kkt_inverse_backward() {
    using enum PlanBuffer;
    Dispatch& d =
        add("kkt_inverse_backward",
            core_kernel("kkt_inverse_backward"),
            {unsigned(C), unsigned(Hv), unsigned(B)},
            kChunkThreads,
            kKktInverseBackwardBytes,
            {{0, Key},
             {1, TinyDecayMask},
             {3, KeyInverseNorm},
             {4, GateCumsum},
             {5, BetaEffective},
             {6, KktInverse},
             {7, KktInverseGrad},
             {8, DecayPairTerms},
             {9, KeyHeadGrad},
             {10, GradBeta},
             {12, KktGrad}},
            11,
            {DecayPairTerms, KeyHeadGrad, GradBeta, KktGrad});
    // X = dT T^T and T^T X (triangular, 64^3 / 3 each).
    d.flops = B * Hv * C * 4.0 * tile() * kChunkSize / 3;
    if (p.per_key_gates) {
      // T and dT read, dA written: channel_pairs_backward takes it on.
      d.bytes_moved =
          chunk_test_bytes(double(T)) + B * Hv * 3 * chunk_tiles() * 4.0;
      return;
    }
    // T and dT read, the pair terms read and written; k read, dk read and
    // written; dbeta.
    d.bytes_moved = chunk_test_bytes(double(T)) +
        B * Hv *
            (4 * chunk_tiles() * 4.0 + T * Dk * double(e) +
             padded_tokens * (2 * Dk + 4) * 4.0);
    // K K^T formed again, and dAk K + dAk^T K.
    d.flops += B * Hv * C * 3.0 * tile() * Dk;
  }

  void channel_pairs_backward() {
    using enum PlanBuffer;
    Dispatch& d =
        add("channel_pairs_backward",
            core_kernel("channel_pairs_backward"),
            {unsigned(C), unsigned(Hv), unsigned(B)},
            kChunkThreads,
            0,
            {{0, Query},
             {1, Key},
             {2, Gate},
             {3, Mask},
             {4, QueryInverseNorm},
             {5, KeyInverseNorm},
             {6, BetaEffective},
             {7, QKGrad},
             {8, KktGrad},
             {9, DecayEntryTerms},
             {10, DecayExitTerms},
             {11, GradGate},
             {12, GradGamma},
             {13, GradBeta},
             {14, QueryHeadGrad},
             {15, KeyHeadGrad},
             {17, TinyDecayMask}},
            16,
            {DecayEntryTerms,
             GradGate,
             GradGamma,
             GradBeta,
             QueryHeadGrad,
             KeyHeadGrad});
    // The tiles dM and dA read (each channel's thread reads them: counted
    // once, caches serve the repeats); q, k and g per channel read; the
    // entry terms read and written (the dbeta terms) and read again, the
    // exit terms read; dq and dk read and written, dg and dgamma written;
    // beta and dbeta.
    d.bytes_moved = chunk_test_bytes(double(T)) + token_mask_bytes(double(T)) +
        B * Hv *
            (2 * chunk_tiles() * 4.0 + T * 2 * Dk * double(e) + T * Dk * 4.0 +
             padded_tokens * Dk * (4 + 4 + 2) * 4.0 + padded_tokens * 3 * 4.0);
    // Per pair (i, t), t <= i, and channel: the running decay, the pair term,
    // four sums and the scan's step, about 16 flops, over half a tile.
    d.flops = 8.0 * B * Hv * C * tile() * Dk;
  }

  void gate_cumsum_backward() {
    using enum PlanBuffer;
    Dispatch& d =
        add("gate_cumsum_backward",
            "gated_delta_gate_cumsum_backward",
            {unsigned(C), unsigned(Hv), unsigned(B)},
            kChunkSize,
            kGateCumsumBackwardBytes,
            {{0, Gate},
             {1, Mask},
             {2, DecayEntryTerms},
             {3, DecayPairTerms},
             {4, GradGate},
             {5, GradGamma},
             {6, GradBeta},
             {7, QueryHeadGrad},
             {8, KeyHeadGrad},
             {10, TinyDecayMask}},
            9,
            {GradGate, GradGamma, GradBeta, QueryHeadGrad, KeyHeadGrad});
    // The pair terms' tiles, the entry terms and g read, dg and dgamma
    // written (masked tokens' rows cleared too: not counted).
    d.bytes_moved = chunk_test_bytes(double(T)) + token_mask_bytes(double(T)) +
        B * Hv * (chunk_tiles() * 4.0 + T * 16.0);
    // Two scans over the lower triangle (half a tile): a multiply-add per
    // pair in each, and the second's running product.
    d.flops = 2.5 * B * Hv * C * tile();
  }

  void backward() {
    if (chunked()) {
      chunked_through_carry();
      boundary_states();
      chunk_output_backward();
    } else {
      boundary_states();
    }
    for (uint64_t chunk = C; chunk-- > 0;) {
      chunk_states(uint32_t(chunk));
      recurrent_chunk_backward(uint32_t(chunk));
      if (chunked())
        chunk_carry_backward(uint32_t(chunk));
    }
    if (chunked()) {
      recompute_w_u_backward();
      kkt_inverse_backward();
      if (p.per_key_gates) {
        channel_pairs_backward();
      } else {
        gate_cumsum_backward();
      }
    }
    qk_grad_reduce();
  }
};

}  // namespace

Plan make_backward_plan(
    const GatedDeltaParams& params,
    ActivationDtype dtype,
    Algorithm algorithm) {
  validate_plan_shape(params);
  if (params.key_dim > int(kMaxBackwardKeyDim)) {
    throw std::invalid_argument(
        "the Metal backward supports key_dim up to " +
        std::to_string(kMaxBackwardKeyDim) + ", got " +
        std::to_string(params.key_dim) + "; take the gradient on the CPU");
  }
  if (params.checkpoint_count > 0 || params.has_tree) {
    throw std::invalid_argument(
        "the backward plan takes no checkpoints and no tree (parents)");
  }
  const Algorithm form = algorithm == Algorithm::Auto
      ? resolve_metal_backward_algorithm(params)
      : algorithm;
  BackwardPlanBuilder builder(params, dtype, form);
  builder.backward();
  return builder.finish();
}

}  // namespace mlx_gated_delta::metal
