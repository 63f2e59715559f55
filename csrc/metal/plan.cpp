#include "metal/plan.h"

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <stdexcept>

#include "validation/extents.h"

namespace mlx_gated_delta::metal {

namespace {

// Metal's limits on Apple GPUs (the emulator enforces the same numbers).
constexpr uint64_t kMaxThreadsPerThreadgroup = 1024;
constexpr size_t kMaxThreadgroupMemoryBytes = 32 * 1024;
constexpr unsigned kMaxBufferIndex = 30;

// Threadgroup memory each kernel declares (its `threadgroup` arrays), from the
// layout constants of kernel_abi.h the kernels size them with.
constexpr size_t kFloat = sizeof(float);
constexpr size_t kChunkTileBytes = kChunkSize * kChunkSize * kFloat;
constexpr size_t kRecurrentGenericBytes = 2 * kMaxGenericKeyDim * kFloat;
constexpr size_t kChunkDotBytes =
    2 * kChunkSize * kDotTileWidth * kFloat + kChunkTileBytes;
// chunk_dot_products: one SIMD-group per 8-row block of a 64 x 64 tile.
static_assert(kChunkThreads / 32 == kChunkSize / 8);
constexpr size_t kKktInverseBytes =
    kChunkTileBytes + 2 * kChunkSize * kDotTileWidth * kFloat;
static_assert(
    kDotTileWidth % 8 == 0,
    "simdgroup matrices step through the tiles 8 columns at a time");
// key_decayed_dot_products: its four staging blocks reuse the two dot-product
// tiles of kkt_inverse and chunk_qk, and each thread keeps a whole number of
// the tile's entries.
static_assert(4 * kKeyDecayTileWidth <= 2 * kDotTileWidth);
static_assert(kChunkSize * kChunkSize % kChunkThreads == 0);
constexpr size_t kRecomputeWuBytes = kChunkTileBytes + 2 * kChunkSize * kFloat;
constexpr size_t kChunkCarryBytes = (kCarryRows * kMaxChunkedKeyDim +
                                     kCarryRows * kChunkSize + 2 * kChunkSize) *
    kFloat;
constexpr size_t kChunkOutputBytes = kChunkTileBytes;
constexpr size_t kChunkBackwardBytes =
    (3 * kBackwardSimdGroups * kMaxBackwardKeyDim + 2 * kBackwardSimdGroups) *
    kFloat;
// The chunked backward's WY stages: a 64 x 64 tile (chunk_output_backward),
// three partial sums per thread (chunk_carry_backward), the T tile and two
// partial sums per thread (recompute_w_u_backward), T and X = dT T^T
// (kkt_inverse_backward).
constexpr size_t kChunkOutputBackwardBytes = kChunkTileBytes;
constexpr size_t kChunkCarryBackwardBytes = 3 * kChunkThreads * kFloat;
constexpr size_t kRecomputeWuBackwardBytes =
    kChunkTileBytes + 2 * kChunkThreads * kFloat;
constexpr size_t kKktInverseBackwardBytes = 2 * kChunkTileBytes;
static_assert(kChunkThreads % kChunkSize == 0);
static_assert((kChunkSize * kChunkSize) % kChunkThreads == 0);
// chunk_backward: thread tid adds up the partial sums of key column tid.
static_assert(kBackwardThreads == kMaxBackwardKeyDim);
static_assert(kBackwardColumnsPerLane * 32 == kMaxBackwardKeyDim);

unsigned ceil_div(uint64_t a, uint64_t b) {
  return unsigned((a + b - 1) / b);
}

std::string kernel_name(const char* stage, ActivationDtype dtype) {
  return std::string("gated_delta_") + stage + "_" + to_string(dtype);
}

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

}  // namespace

const char* to_string(ActivationDtype dtype) {
  switch (dtype) {
    case ActivationDtype::Float32:
      return "float32";
    case ActivationDtype::Float16:
      return "float16";
    case ActivationDtype::BFloat16:
      return "bfloat16";
  }
  return "?";
}

size_t element_bytes(ActivationDtype dtype) {
  return dtype == ActivationDtype::Float32 ? 4 : 2;
}

const char* to_string(PlanBuffer buffer) {
  static const char* const names[] = {
      "q",
      "k",
      "v",
      "g",
      "beta",
      "mask",
      "state_in",
      "y",
      "state_out",
      "query_inverse_norm",
      "key_inverse_norm",
      "gate_cumsum",
      "last_wipe",
      "beta_effective",
      "k_gram",
      "kkt_inverse",
      "w",
      "u",
      "qk",
      "output_inter",
      "mixed",
      "conv_weight",
      "decay_parameter",
      "dt_bias",
      "norm_weight",
      "conv_state_in",
      "out",
      "conv_state_out",
      "checkpoints",
      "checkpoint_states",
      "conv_checkpoint_states",
      "parents",
      "tree_states",
      "y_cotangent",
      "state_cotangent",
      "dq",
      "dk",
      "dv",
      "dg",
      "d_decay",
      "dbeta",
      "dstate",
      "boundary_states",
      "chunk_states",
      "query_head_grad",
      "key_head_grad",
      "corrected_grad",
      "w_grad",
      "kkt_inverse_grad",
      "gate_cumsum_grad"};
  static_assert(sizeof(names) / sizeof(names[0]) == size_t(PlanBuffer::Count));
  return names[int(buffer)];
}

const BufferSpec* Plan::find_buffer(PlanBuffer buffer) const {
  for (const BufferSpec& spec : buffers) {
    if (spec.buffer == buffer)
      return &spec;
  }
  return nullptr;
}

uint64_t Plan::buffer_bytes(PlanBuffer buffer) const {
  const BufferSpec* spec = find_buffer(buffer);
  return spec ? spec->bytes : 0;
}

const void* Plan::params_data(const Dispatch& dispatch) const {
  return dispatch.params_block == KernelParamsBlock::Core
      ? static_cast<const void*>(&kernel_params)
      : static_cast<const void*>(&segment_params);
}

size_t Plan::params_size(const Dispatch& dispatch) const {
  return dispatch.params_block == KernelParamsBlock::Core
      ? sizeof(kernel_params)
      : sizeof(segment_params);
}

namespace {

// Builds a plan one stage at a time: the constructor binds the core call's
// inputs and outputs, each stage method adds its dispatch (and, for the
// chunked stages, chunked_scratch() their scratch first). A segment plan is
// the same builder with the segment's buffers and stages around the core's.
struct PlanBuilder {
  const GatedDeltaParams& p;
  Plan plan;
  ActivationDtype core_dtype;  // of q, k, v, y: float32 inside a segment
  uint64_t B, T, Hk, Hv, Dk, Dv, C, padded_tokens, e;

  PlanBuilder(
      const GatedDeltaParams& params,
      Algorithm algorithm,
      ActivationDtype dtype)
      : p(params), core_dtype(dtype) {
    plan.algorithm =
        algorithm == Algorithm::Auto ? resolve_metal_algorithm(p) : algorithm;
    plan.dtype = dtype;
    B = p.batch;
    T = p.tokens;
    Hk = p.key_heads;
    Hv = p.value_heads;
    Dk = p.key_dim;
    Dv = p.value_dim;
    C = p.num_chunks();
    padded_tokens = C * kChunkSize;
    e = element_bytes(dtype);
    GatedDeltaKernelParams& k = plan.kernel_params;
    set_kernel_shape(k, p);
    k.value_heads_per_key_head = p.value_heads / p.key_heads;
    k.head_mapping = p.head_mapping == HeadMapping::Grouped ? 0 : 1;
    k.normalize_qk = p.normalize_qk ? 1 : 0;
    k.has_mask = p.has_mask ? 1 : 0;
    k.num_chunks = unsigned(C);
    k.scale = p.scale;
    k.num_checkpoints = unsigned(p.checkpoint_count);
    k.has_tree = p.has_tree ? 1 : 0;
    if (p.has_tree && algorithm == Algorithm::Chunked) {
      throw std::invalid_argument(
          "tree verification (parents) runs the recurrent plan only");
    }
    k.per_key_gates = p.per_key_gates ? 1 : 0;

    using enum BufferRole;
    add_buffer(PlanBuffer::Query, B * T * Hk * Dk * e, Input);
    add_buffer(PlanBuffer::Key, B * T * Hk * Dk * e, Input);
    add_buffer(PlanBuffer::Value, B * T * Hv * Dv * e, Input);
    add_buffer(
        PlanBuffer::Gate, B * T * Hv * uint64_t(p.gate_width()) * 4, Input);
    add_buffer(PlanBuffer::Beta, B * T * Hv * 4, Input);
    if (p.has_mask)
      add_buffer(PlanBuffer::Mask, B * T, Input);
    add_buffer(PlanBuffer::StateIn, B * Hv * Dv * Dk * 4, Input);
    add_buffer(PlanBuffer::Output, B * T * Hv * Dv * e, Output);
    add_buffer(PlanBuffer::StateOut, B * Hv * Dv * Dk * 4, Output);
    if (p.checkpoint_count > 0) {
      const uint64_t N = p.checkpoint_count;
      check_launch_extent("checkpoint state elements", N * B * Hv * Dv * Dk);
      add_buffer(PlanBuffer::Checkpoints, N * 4, Input);
      add_buffer(
          PlanBuffer::CheckpointStates, N * B * Hv * Dv * Dk * 4, Output);
    }
    if (p.has_tree) {
      add_buffer(PlanBuffer::Parents, T * 4, Input);
      add_scratch(
          PlanBuffer::TreeStates,
          "tree state elements",
          B * Hv * T * Dv * Dk,
          4);
    }
  }

  void add_buffer(PlanBuffer buffer, uint64_t bytes, BufferRole role) {
    plan.buffers.push_back({buffer, bytes, role});
  }
  // Scratch is indexed by the kernels with 32-bit integers too.
  void add_scratch(
      PlanBuffer buffer,
      const char* what,
      uint64_t elements,
      uint64_t bytes_each) {
    check_launch_extent(what, elements);
    add_buffer(buffer, elements * bytes_each, BufferRole::Scratch);
  }

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
      const std::vector<PlanBuffer>& writes) {
    Dispatch d;
    d.stage = stage;
    d.kernel = std::move(kernel);
    d.threadgroups = groups;
    d.threads_per_threadgroup = {threads, 1, 1};
    d.threadgroup_memory_bytes = threadgroup_bytes;
    for (auto [index, buffer] : bindings) {
      bool written =
          std::find(writes.begin(), writes.end(), buffer) != writes.end();
      if (plan.buffer_bytes(buffer) > 0)
        d.buffers.push_back({index, buffer, written});
    }
    d.params_index = params_index;
    plan.dispatches.push_back(std::move(d));
    return plan.dispatches.back();
  }

  std::string core_kernel(const char* stage) const {
    return kernel_name(stage, core_dtype);
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

  // The core's stages, in order.
  void core() {
    if (plan.algorithm == Algorithm::Recurrent) {
      recurrent();
      return;
    }
    if (p.normalize_qk)
      qk_norm();
    gate_cumsum();
    if (uses_k_gram())
      k_gram();
    kkt_inverse();
    recompute_w_u();
    chunk_qk();
    chunk_carry();
    chunk_output();
  }

  void recurrent() {
    using enum PlanBuffer;
    const bool simd = supports_simd_delta(p, 32);
    if (!simd && Dk > kMaxGenericKeyDim) {
      throw std::invalid_argument(
          "the Metal recurrent kernel supports key_dim up to " +
          std::to_string(kMaxGenericKeyDim) + ", got " + std::to_string(Dk));
    }
    const unsigned rows = simd ? kRecurrentSimdRows : kRecurrentGenericRows;
    Dispatch& d =
        add("recurrent",
            core_kernel(simd ? "recurrent_simd" : "recurrent_generic"),
            {ceil_div(Dv, rows), unsigned(Hv), unsigned(B)},
            simd ? rows * 32 : rows,
            simd ? 0 : kRecurrentGenericBytes,
            {{0, Query},
             {1, Key},
             {2, Value},
             {3, Gate},
             {4, Beta},
             {5, Mask},
             {6, StateIn},
             {7, StateOut},
             {8, Output},
             {10, Checkpoints},
             {11, CheckpointStates},
             {12, Parents},
             {13, TreeStates}},
            9,
            {StateOut, Output, CheckpointStates, TreeStates});
    // Per value head: q, k (read once per head), v, g (one or Dk floats),
    // beta, y; the state once each way.
    d.bytes_moved = double(
        B * T * Hv * (2 * Dk * e + 2 * Dv * e + 4 + 4 * p.gate_width()) +
        (2 + p.checkpoint_count) * B * Hv * Dv * Dk * 4 +
        (p.has_tree ? 2 * B * Hv * T * Dv * Dk * 4 : 0));
    d.flops = 8.0 * B * T * Hv * Dk * Dv;
  }

  // The scratch the chunked stages pass each other (nothing for recurrent).
  void chunked_scratch() {
    using enum PlanBuffer;
    if (plan.algorithm != Algorithm::Chunked)
      return;
    if (Dk > kMaxChunkedKeyDim) {
      throw std::invalid_argument(
          "the Metal chunked kernels support key_dim up to " +
          std::to_string(kMaxChunkedKeyDim) + ", got " + std::to_string(Dk));
    }
    if (p.normalize_qk) {
      add_scratch(QueryInverseNorm, "query norm elements", B * T * Hk, 4);
      add_scratch(KeyInverseNorm, "key norm elements", B * T * Hk, 4);
    }
    // Per-key gates: the cumulative log decay and last wipe per key channel,
    // [B, Hv, C, 64, Dk].
    const uint64_t gate_rows =
        B * Hv * padded_tokens * uint64_t(p.gate_width());
    add_scratch(GateCumsum, "gate cumsum elements", gate_rows, 4);
    add_scratch(LastWipe, "last wipe elements", gate_rows, 4);
    add_scratch(BetaEffective, "beta elements", B * Hv * padded_tokens, 4);
    if (uses_k_gram())
      add_scratch(KGram, "k gram elements", B * Hk * chunk_tiles(), 4);
    add_scratch(KktInverse, "kkt inverse elements", B * Hv * chunk_tiles(), 4);
    add_scratch(W, "W elements", B * Hv * padded_tokens * Dk, 4);
    add_scratch(U, "U elements", B * Hv * padded_tokens * Dv, 4);
    add_scratch(QK, "QK elements", B * qk_heads() * chunk_tiles(), 4);
    add_scratch(
        OutputInter,
        "inter-chunk output elements",
        B * Hv * padded_tokens * Dv,
        4);
  }

  void qk_norm() {
    using enum PlanBuffer;
    Dispatch& d =
        add("qk_norm",
            core_kernel("qk_norm"),
            {ceil_div(B * T * Hk, kNormRowsPerThreadgroup), 1, 1},
            kNormRowsPerThreadgroup * 32,
            0,
            {{0, Query}, {1, Key}, {2, QueryInverseNorm}, {3, KeyInverseNorm}},
            4,
            {QueryInverseNorm, KeyInverseNorm});
    d.bytes_moved = double(B * T * Hk * (2 * Dk * e + 8));
    d.flops = 4.0 * B * T * Hk * Dk;
  }

  void gate_cumsum() {
    using enum PlanBuffer;
    Dispatch& d = add(
        "gate_cumsum",
        "gated_delta_gate_cumsum",
        {ceil_div(B * Hv * C * uint64_t(p.gate_width()), kCumsumThreads), 1, 1},
        kCumsumThreads,
        0,
        {{0, Gate},
         {1, Beta},
         {2, Mask},
         {3, GateCumsum},
         {4, LastWipe},
         {5, BetaEffective}},
        6,
        {GateCumsum, LastWipe, BetaEffective});
    const double width = p.gate_width();
    d.bytes_moved = B * T * Hv * (width + 1) * 4.0 +
        B * T * (p.has_mask ? 1 : 0) +
        B * Hv * padded_tokens * (2 * width + 1) * 4.0;
    d.flops = B * T * Hv * width;
  }

  void k_gram() {
    using enum PlanBuffer;
    Dispatch& d =
        add("k_gram",
            core_kernel("k_gram"),
            {unsigned(C), unsigned(Hk), unsigned(B)},
            kChunkThreads,
            kChunkDotBytes,
            {{0, Key}, {1, KeyInverseNorm}, {2, KGram}},
            3,
            {KGram});
    d.bytes_moved = double(B * T * Hk * Dk * e + B * Hk * chunk_tiles() * 4);
    d.flops = 2.0 * B * Hk * C * tile() * Dk;
  }

  void kkt_inverse() {
    using enum PlanBuffer;
    const bool k_gram = uses_k_gram();
    Dispatch& d =
        add("kkt_inverse",
            core_kernel(k_gram ? "kkt_inverse_from_k_gram" : "kkt_inverse"),
            {unsigned(C), unsigned(Hv), unsigned(B)},
            kChunkThreads,
            kKktInverseBytes,
            {{0, Key},
             {1, KeyInverseNorm},
             {2, KGram},
             {3, GateCumsum},
             {4, LastWipe},
             {5, BetaEffective},
             {6, KktInverse}},
            7,
            {KktInverse});
    // Gram (read, or built from K), the decays and beta, then the
    // triangular solve (about 64^3 / 3 flops per chunk); T written whole.
    // Per-key gates: the decayed gram's lower half, four flops and an exp
    // per pair and channel, from K and the per-channel decays.
    double gram_bytes =
        k_gram ? B * Hv * chunk_tiles() * 4.0 : B * Hv * T * Dk * double(e);
    double gram_flops = k_gram ? 0.0 : 2.0 * tile() * Dk;
    if (p.per_key_gates) {
      gram_bytes += B * Hv * padded_tokens * Dk * 8.0;
      gram_flops = 5.0 * (tile() / 2) * Dk;
    }
    d.bytes_moved = gram_bytes + B * Hv * padded_tokens * 12.0 +
        B * Hv * chunk_tiles() * 4.0;
    d.flops = B * Hv * C * (gram_flops + 3 * tile() + tile() * kChunkSize / 3);
  }

  void recompute_w_u() {
    using enum PlanBuffer;
    Dispatch& d =
        add("recompute_w_u",
            core_kernel("recompute_w_u"),
            {unsigned(C), unsigned(Hv), unsigned(B)},
            kChunkThreads,
            kRecomputeWuBytes,
            {{0, Key},
             {1, Value},
             {2, KeyInverseNorm},
             {3, GateCumsum},
             {4, LastWipe},
             {5, BetaEffective},
             {6, KktInverse},
             {7, W},
             {8, U}},
            9,
            {W, U});
    d.bytes_moved = B * Hv *
        (T * (Dk + Dv) * double(e) + chunk_tiles() * 4.0 +
         padded_tokens * (Dk + Dv) * 4.0);
    d.flops = 2.0 * B * Hv * C * (tile() / 2) * (Dk + Dv);
  }

  void chunk_qk() {
    using enum PlanBuffer;
    std::vector<std::pair<unsigned, PlanBuffer>> bindings = {
        {0, Query},
        {1, Key},
        {2, QueryInverseNorm},
        {3, KeyInverseNorm},
        {4, QK}};
    if (p.per_key_gates) {
      bindings.insert(bindings.end(), {{6, GateCumsum}, {7, LastWipe}});
    }
    Dispatch& d =
        add("chunk_qk",
            core_kernel("chunk_qk"),
            {unsigned(C), unsigned(qk_heads()), unsigned(B)},
            kChunkThreads,
            kChunkDotBytes,
            bindings,
            5,
            {QK});
    // Per-key gates: one decayed tile per value head (the lower half, four
    // flops and an exp per pair and channel), reading the channels' decays.
    const double heads = double(qk_heads());
    d.bytes_moved = B * heads *
        (2.0 * T * Dk * double(e) + chunk_tiles() * 4.0 +
         (p.per_key_gates ? padded_tokens * Dk * 8.0 : 0.0));
    d.flops = p.per_key_gates ? 5.0 * B * heads * C * (tile() / 2) * Dk
                              : 2.0 * B * heads * C * tile() * Dk;
  }

  void chunk_carry() {
    using enum PlanBuffer;
    Dispatch& d =
        add("chunk_carry",
            core_kernel("chunk_carry"),
            {ceil_div(Dv, kCarryRows), unsigned(Hv), unsigned(B)},
            kCarryRows * kChunkSize,
            kChunkCarryBytes,
            {{0, Query},
             {1, Key},
             {2, QueryInverseNorm},
             {3, KeyInverseNorm},
             {4, GateCumsum},
             {5, LastWipe},
             {6, W},
             {7, U},
             {8, StateIn},
             {9, StateOut},
             {10, OutputInter},
             {12, Checkpoints},
             {13, CheckpointStates}},
            11,
            {U, StateOut, OutputInter, CheckpointStates});
    // Each of the Dv / kCarryRows threadgroups of a head reads the chunk's
    // W, q and k rows (caches serve the repeats; counted once per head),
    // U and writes v' and the inter-chunk output; the state once each way.
    d.bytes_moved = B * Hv *
        (padded_tokens * (Dk + 3 * Dv) * 4.0 + 2 * T * Dk * double(e) +
         (2 + p.checkpoint_count) * Dv * Dk * 4.0);
    // Per token and state row: v' (W S^T), the inter-chunk readout (S q)
    // and the state update (sum_j v'_j k_j^T): three Dk-long dot products;
    // a checkpoint cut in a chunk is at most one more update.
    d.flops = 6.0 * B * Hv * T * Dk * Dv +
        2.0 * p.checkpoint_count * B * Hv * kChunkSize * Dk * Dv;
  }

  void chunk_output() {
    using enum PlanBuffer;
    Dispatch& d =
        add("chunk_output",
            core_kernel("chunk_output"),
            {unsigned(C), unsigned(Hv), unsigned(B)},
            kChunkThreads,
            kChunkOutputBytes,
            {{0, QK},
             {1, GateCumsum},
             {2, LastWipe},
             {3, Mask},
             {4, U},
             {5, OutputInter},
             {6, Output}},
            7,
            {Output});
    d.bytes_moved = B * Hv *
        (chunk_tiles() * 4.0 + padded_tokens * (2 * Dv * 4.0 + 8) +
         T * Dv * double(e));
    d.flops = 2.0 * B * Hv * C * (tile() / 2) * Dv;
  }

  // No tokens (T == 0, chunked): the per-chunk stages have empty grids and
  // are left out; the carry still copies the state.
  Plan finish() {
    std::erase_if(plan.dispatches, [](const Dispatch& d) {
      return d.threadgroups.count() == 0;
    });
    validate_plan(plan);
    return std::move(plan);
  }
};

// The segment's stages around the core's: q, k, v, g, beta and y become
// float32 scratch between them, and the segment's own buffers are added.
struct SegmentPlanBuilder : PlanBuilder {
  const SegmentParams& sp;
  uint64_t channels, packed, taps, conv_rows, segment_e;
  unsigned channel_threads, channel_groups;

  SegmentPlanBuilder(
      const SegmentParams& params,
      const GatedDeltaParams& core_params,
      Algorithm algorithm,
      ActivationDtype dtype)
      : PlanBuilder(core_params, algorithm, ActivationDtype::Float32),
        sp(params) {
    using enum PlanBuffer;
    plan.dtype = dtype;
    channels = sp.conv_channels();
    packed = sp.packed_width();
    taps = sp.conv_kernel;
    conv_rows = sp.conv_state_rows();
    segment_e = element_bytes(dtype);
    // One thread per channel: a threadgroup spans up to kSegmentThreads
    // channels.
    channel_threads = unsigned(
        std::min<uint64_t>(kSegmentThreads, (channels + 31) / 32 * 32));
    channel_groups = ceil_div(channels, channel_threads);

    chunked_scratch();
    for (BufferSpec& spec : plan.buffers) {
      if (spec.buffer == Query || spec.buffer == Key || spec.buffer == Value ||
          spec.buffer == Gate || spec.buffer == Beta || spec.buffer == Output) {
        spec.role = BufferRole::Scratch;
      }
    }
    const uint64_t Fe = B * T * packed * segment_e,
                   state_bytes = B * conv_rows * channels * segment_e;
    add_buffer(Mixed, Fe, BufferRole::Input);
    add_buffer(ConvWeight, channels * taps * 4, BufferRole::Input);
    add_buffer(DecayParameter, Hv * 4, BufferRole::Input);
    add_buffer(DtBias, Hv * 4, BufferRole::Input);
    add_buffer(NormWeight, Dv * 4, BufferRole::Input);
    add_buffer(ConvStateIn, state_bytes, BufferRole::Input);
    add_buffer(SegmentOutput, B * T * Hv * Dv * segment_e, BufferRole::Output);
    add_buffer(ConvStateOut, state_bytes, BufferRole::Output);
    if (sp.checkpoint_count > 0) {
      check_launch_extent(
          "conv checkpoint state elements",
          sp.checkpoint_count * B * conv_rows * channels);
      add_buffer(
          ConvCheckpointStates,
          sp.checkpoint_count * state_bytes,
          BufferRole::Output);
    }

    SegmentKernelParams& k = plan.segment_params;
    set_kernel_shape(k, sp);
    k.conv_kernel = sp.conv_kernel;
    k.conv_channels = unsigned(channels);
    k.packed_width = unsigned(packed);
    k.z_offset = sp.z_offset();
    k.b_offset = sp.b_offset();
    k.a_offset = sp.a_offset();
    k.log_rate =
        sp.decay_parameterization == DecayParameterization::LogRate ? 1 : 0;
    k.has_mask = sp.has_mask ? 1 : 0;
    k.norm_eps = sp.norm_eps;
  }

  Dispatch& add_segment(
      const char* stage,
      Grid3 groups,
      unsigned threads,
      const std::vector<std::pair<unsigned, PlanBuffer>>& bindings,
      unsigned params_index,
      const std::vector<PlanBuffer>& writes) {
    Dispatch& d =
        add(stage,
            kernel_name((std::string("segment_") + stage).c_str(), plan.dtype),
            groups,
            threads,
            0,
            bindings,
            params_index,
            writes);
    d.params_block = KernelParamsBlock::Segment;
    return d;
  }

  void prepare_conv() {
    using enum PlanBuffer;
    Dispatch& d = add_segment(
        "prepare_conv",
        {channel_groups, unsigned(T), unsigned(B)},
        channel_threads,
        {{0, Mixed},
         {1, ConvWeight},
         {2, ConvStateIn},
         {3, Mask},
         {4, Query},
         {5, Key},
         {6, Value}},
        7,
        {Query, Key, Value});
    // Each input read once (the windows' repeats come from caches), q|k|v
    // written float32; K multiply-adds and a SiLU per output.
    d.bytes_moved =
        double(B * T * channels * (segment_e + 4) + channels * taps * 4);
    d.flops = double(B * T * channels * (2 * taps + 4));
  }

  void prepare_gates() {
    using enum PlanBuffer;
    Dispatch& d = add_segment(
        "prepare_gates",
        {ceil_div(B * T * Hv, kSegmentThreads), 1, 1},
        kSegmentThreads,
        {{0, Mixed}, {1, DecayParameter}, {2, DtBias}, {3, Gate}, {4, Beta}},
        5,
        {Gate, Beta});
    d.bytes_moved = double(B * T * Hv * (2 * segment_e + 8));
    d.flops = double(B * T * Hv * 12);
  }

  void collect_conv_state() {
    using enum PlanBuffer;
    Dispatch& d = add_segment(
        "collect_conv_state",
        {channel_groups, unsigned(conv_rows), unsigned(B)},
        channel_threads,
        {{0, Mixed}, {1, ConvStateIn}, {2, Mask}, {3, ConvStateOut}},
        4,
        {ConvStateOut});
    d.bytes_moved = double(2 * B * conv_rows * channels * segment_e);
  }

  // Only with checkpoints: collect_conv_state for the call cut after each one.
  void collect_conv_checkpoints() {
    using enum PlanBuffer;
    if (sp.checkpoint_count == 0)
      return;
    Dispatch& d = add_segment(
        "collect_conv_checkpoints",
        {channel_groups,
         unsigned(conv_rows),
         unsigned(sp.checkpoint_count * B)},
        channel_threads,
        {{0, Mixed},
         {1, ConvStateIn},
         {2, Mask},
         {3, Checkpoints},
         {4, ConvCheckpointStates}},
        5,
        {ConvCheckpointStates});
    d.bytes_moved =
        double(2 * sp.checkpoint_count * B * conv_rows * channels * segment_e);
  }

  void gated_norm() {
    using enum PlanBuffer;
    Dispatch& d = add_segment(
        "gated_norm",
        {ceil_div(B * T * Hv, kGatedNormRowsPerThreadgroup), 1, 1},
        kGatedNormRowsPerThreadgroup * 32,
        {{0, Output},
         {1, Mixed},
         {2, NormWeight},
         {3, Mask},
         {4, SegmentOutput}},
        5,
        {SegmentOutput});
    d.bytes_moved = double(B * T * Hv * Dv * (4 + 2 * segment_e));
    d.flops = double(B * T * Hv * Dv * 10);
  }
};

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
    add_buffer(GradDecay, gates * 4, output);
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
      add_scratch(GateCumsumGrad, "dG elements", B * Hv * padded_tokens, 4);
      plan.kernel_params.recurrent_wipe_chunks_only = 1;
    }
  }

  bool chunked() const {
    return plan.algorithm == Algorithm::Chunked;
  }
  // Bytes of the gates the chunk test (chunk_decays_normal) reads: g, and the
  // mask, of every token once per value head.
  double chunk_test_bytes(double tokens) const {
    return B * Hv * tokens * (4.0 + (p.has_mask ? 1 : 0));
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
             {6, ChunkStates}},
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

  void chunk_backward(uint32_t chunk) {
    using enum PlanBuffer;
    Dispatch& d =
        add("chunk_backward",
            core_kernel("chunk_backward"),
            {unsigned(Hv), unsigned(B), 1},
            kBackwardThreads,
            kChunkBackwardBytes,
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
             {13, GradDecay},
             {14, GradBeta}},
            15,
            {GradState,
             QueryHeadGrad,
             KeyHeadGrad,
             GradValue,
             GradGate,
             GradDecay,
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
    Dispatch& d =
        add("chunk_output_backward",
            core_kernel("chunk_output_backward"),
            {unsigned(C), unsigned(Hv), unsigned(B)},
            kChunkThreads,
            kChunkOutputBackwardBytes,
            {{0, Query},
             {1, Key},
             {2, Gate},
             {3, Mask},
             {4, QueryInverseNorm},
             {5, KeyInverseNorm},
             {6, GateCumsum},
             {7, QK},
             {8, U},
             {9, YCotangent},
             {10, CorrectedGrad},
             {11, GateCumsumGrad},
             {12, QueryHeadGrad},
             {13, KeyHeadGrad}},
            14,
            {CorrectedGrad, GateCumsumGrad, QueryHeadGrad, KeyHeadGrad});
    // dy, q, k and V' read, Q K^T per value head; dV', dq, dk and dG written.
    d.bytes_moved = chunk_test_bytes(double(T)) +
        B * Hv *
            (T * (Dv + 2 * Dk) * double(e) + chunk_tiles() * 4.0 +
             padded_tokens * (2 * Dv + 2 * Dk + 2) * 4.0);
    // dM, dV', dq and dk: four triangular 64 x 64 products per chunk.
    d.flops = 2.0 * B * Hv * C * tile() * (Dv + Dk);
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
             {2, Gate},
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
             {14, GateCumsumGrad},
             {15, QueryHeadGrad},
             {16, KeyHeadGrad}},
            17,
            {GradState,
             CorrectedGrad,
             WGrad,
             GateCumsumGrad,
             QueryHeadGrad,
             KeyHeadGrad});
    d.chunk = ChunkScalar{18, chunk};
    const double length = double(
        std::min<uint64_t>(kChunkSize, T - uint64_t(chunk) * kChunkSize));
    // dS read and written, S0 read; per token dy, q, k, V', W read, dV' read
    // and written, dW written, dq and dk read and written.
    d.bytes_moved = chunk_test_bytes(length) +
        B * Hv *
            (3.0 * Dv * Dk * 4 + length * (Dv + 2 * Dk) * double(e) +
             length * (3 * Dv + 6 * Dk) * 4.0);
    // Six [L, Dv] x [Dv, Dk]-sized products: dS k, S0^T dO, dS^T V', dW, and
    // dS0's two sums.
    d.flops = 12.0 * B * Hv * length * Dv * Dk;
  }

  void recompute_w_u_backward() {
    using enum PlanBuffer;
    Dispatch& d =
        add("recompute_w_u_backward",
            core_kernel("recompute_w_u_backward"),
            {unsigned(C), unsigned(Hv), unsigned(B)},
            kChunkThreads,
            kRecomputeWuBackwardBytes,
            {{0, Key},
             {1, Value},
             {2, Gate},
             {3, Mask},
             {4, KeyInverseNorm},
             {5, GateCumsum},
             {6, BetaEffective},
             {7, KktInverse},
             {8, CorrectedGrad},
             {9, WGrad},
             {10, KktInverseGrad},
             {11, GateCumsumGrad},
             {12, KeyHeadGrad},
             {13, GradValue},
             {14, GradBeta}},
            15,
            {KktInverseGrad, GateCumsumGrad, KeyHeadGrad, GradValue, GradBeta});
    // T read and dT written; dV', dW, v and k read; dv written, dk read and
    // written, dbeta and dG.
    d.bytes_moved = chunk_test_bytes(double(T)) +
        B * Hv *
            (2 * chunk_tiles() * 4.0 + padded_tokens * (Dv + 3 * Dk + 4) * 4.0 +
             T * (2 * Dv + Dk) * double(e));
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
             {1, Gate},
             {2, Mask},
             {3, KeyInverseNorm},
             {4, GateCumsum},
             {5, BetaEffective},
             {6, KktInverse},
             {7, KktInverseGrad},
             {8, GateCumsumGrad},
             {9, KeyHeadGrad},
             {10, GradBeta}},
            11,
            {GateCumsumGrad, KeyHeadGrad, GradBeta});
    // T and dT read; k read, dk read and written; dbeta and dG.
    d.bytes_moved = chunk_test_bytes(double(T)) +
        B * Hv *
            (2 * chunk_tiles() * 4.0 + T * Dk * double(e) +
             padded_tokens * (2 * Dk + 4) * 4.0);
    // X = dT T^T and T^T X (triangular, 64^3 / 3 each), K K^T formed again,
    // and dAk K + dAk^T K.
    d.flops = B * Hv * C * (4.0 * tile() * kChunkSize / 3 + 3.0 * tile() * Dk);
  }

  void gate_cumsum_backward() {
    using enum PlanBuffer;
    Dispatch& d =
        add("gate_cumsum_backward",
            "gated_delta_gate_cumsum_backward",
            {unsigned(C), unsigned(Hv), unsigned(B)},
            kChunkSize,
            0,
            {{0, Gate},
             {1, Mask},
             {2, GateCumsumGrad},
             {3, GradGate},
             {4, GradDecay},
             {5, GradBeta},
             {6, QueryHeadGrad},
             {7, KeyHeadGrad}},
            8,
            {GradGate, GradDecay, GradBeta, QueryHeadGrad, KeyHeadGrad});
    // dG and g read, dg and d_decay written (masked tokens' rows cleared too:
    // not counted).
    d.bytes_moved = chunk_test_bytes(double(T)) + B * Hv * T * 16.0;
    d.flops = 2.0 * B * Hv * T;
  }

  void backward() {
    if (chunked()) {
      if (p.normalize_qk)
        qk_norm();
      gate_cumsum();
      if (uses_k_gram())
        k_gram();
      kkt_inverse();
      recompute_w_u();
      chunk_qk();
      chunk_carry();
      boundary_states();
      chunk_output_backward();
    } else {
      boundary_states();
    }
    for (uint64_t chunk = C; chunk-- > 0;) {
      chunk_states(uint32_t(chunk));
      chunk_backward(uint32_t(chunk));
      if (chunked())
        chunk_carry_backward(uint32_t(chunk));
    }
    if (chunked()) {
      recompute_w_u_backward();
      kkt_inverse_backward();
      gate_cumsum_backward();
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
  // The WY stages have one decay per head: per-key gates take the
  // recurrent form whatever was asked, as in the forward.
  const Algorithm form = algorithm == Algorithm::Auto || params.per_key_gates
      ? resolve_metal_backward_algorithm(params)
      : algorithm;
  BackwardPlanBuilder builder(params, dtype, form);
  builder.backward();
  return builder.finish();
}

Plan make_plan(
    const GatedDeltaParams& params,
    Algorithm algorithm,
    ActivationDtype dtype) {
  validate_plan_shape(params);
  PlanBuilder builder(params, algorithm, dtype);
  builder.chunked_scratch();
  builder.core();
  return builder.finish();
}

Plan make_segment_plan(
    const SegmentParams& sp, Algorithm algorithm, ActivationDtype dtype) {
  validate_segment_plan_shape(sp);
  // The core reads float32 q, k, v, g and beta that the segment's stages
  // write, and its float32 y feeds gated_norm.
  const GatedDeltaParams core = sp.core_params();
  validate_plan_shape(core);
  SegmentPlanBuilder builder(sp, core, algorithm, dtype);
  builder.prepare_conv();
  builder.prepare_gates();
  builder.collect_conv_state();
  builder.collect_conv_checkpoints();
  builder.core();
  builder.gated_norm();
  return builder.finish();
}

void validate_plan(const Plan& plan) {
  for (const Dispatch& d : plan.dispatches) {
    uint64_t threads = d.threads_per_threadgroup.count();
    if (threads == 0 || threads > kMaxThreadsPerThreadgroup) {
      throw std::invalid_argument(
          d.kernel + ": " + std::to_string(threads) +
          " threads per threadgroup (Metal allows 1 to 1024)");
    }
    if (d.threadgroup_memory_bytes > kMaxThreadgroupMemoryBytes) {
      throw std::invalid_argument(
          d.kernel + ": " + std::to_string(d.threadgroup_memory_bytes) +
          " bytes of threadgroup memory (Metal allows 32768)");
    }
    for (const auto& [index, buffer, written] : d.buffers) {
      const BufferSpec* spec = plan.find_buffer(buffer);
      if (spec == nullptr) {
        throw std::invalid_argument(
            d.kernel + " binds " + to_string(buffer) +
            ", which the plan does not have");
      }
      if (written && spec->role == BufferRole::Input) {
        throw std::invalid_argument(
            d.kernel + " would write its input " + to_string(buffer));
      }
      if (index > kMaxBufferIndex || index == d.params_index) {
        throw std::invalid_argument(
            d.kernel + ": buffer index " + std::to_string(index) + " for " +
            to_string(buffer) + " is out of range or taken");
      }
    }
    if (d.params_index > kMaxBufferIndex) {
      throw std::invalid_argument(d.kernel + ": params index over 30");
    }
    if (d.chunk) {
      const unsigned index = d.chunk->index;
      const bool taken = index == d.params_index ||
          std::any_of(d.buffers.begin(),
                      d.buffers.end(),
                      [&](const Binding& b) { return b.index == index; });
      if (index > kMaxBufferIndex || taken) {
        throw std::invalid_argument(
            d.kernel + ": chunk index " + std::to_string(index) +
            " is out of range or taken");
      }
    }
  }
}

Roofline assumed_m_series_roofline() {
  // Apple M3 Max (40-core GPU), the figures assumed on paper: 400 GB/s of
  // unified-memory bandwidth and about 14 TFLOP/s float32 (40 cores x 128 ALUs
  // x 2 flops x ~1.4 GHz). Not measured here: there is no Apple GPU.
  return {
      "Apple M3 Max (40-core GPU), assumed: 400 GB/s, 14.3 TFLOP/s float32",
      400e9,
      14.3e12};
}

std::string describe_plan(const Plan& plan, const Roofline& roofline) {
  const GatedDeltaKernelParams& k = plan.kernel_params;
  std::ostringstream out;
  char line[512];
  out << (plan.backward ? "backward plan: " : "plan: ")
      << to_string(plan.algorithm) << ", " << to_string(plan.dtype)
      << " activations, B=" << k.batch << " T=" << k.tokens
      << " Hk=" << k.key_heads << " Hv=" << k.value_heads << " Dk=" << k.key_dim
      << " Dv=" << k.value_dim
      << (k.head_mapping == 0 ? " grouped" : " interleaved")
      << (k.normalize_qk ? " normalize_qk" : "") << (k.has_mask ? " mask" : "")
      << "\n";
  out << "roofline: " << roofline.chip << "\n";
  out << "dispatches: " << plan.dispatches.size() << "\n";
  // The dispatches of a per-chunk stage (the backward walks its chunks one
  // dispatch each) share one row: "stage xN", their sums.
  struct Row {
    const Dispatch* first;
    unsigned count = 0;
    double bytes = 0, flops = 0, t_mem = 0, t_flop = 0, time = 0;
  };
  std::vector<Row> rows;
  for (const Dispatch& d : plan.dispatches) {
    auto row = std::find_if(rows.begin(), rows.end(), [&](const Row& r) {
      return d.chunk && r.first->chunk && r.first->stage == d.stage;
    });
    if (row == rows.end()) {
      rows.push_back({&d});
      row = rows.end() - 1;
    }
    const double t_mem = d.bytes_moved / roofline.bytes_per_second * 1e6;
    const double t_flop = d.flops / roofline.flops_per_second * 1e6;
    ++row->count;
    row->bytes += d.bytes_moved;
    row->flops += d.flops;
    row->t_mem += t_mem;
    row->t_flop += t_flop;
    row->time += std::max(t_mem, t_flop);
  }
  std::snprintf(
      line,
      sizeof(line),
      "%-26s %-48s %18s %8s %9s %10s %11s %10s %10s %6s\n",
      "stage",
      "kernel",
      "threadgroups",
      "threads",
      "tg bytes",
      "MB moved",
      "GFLOP",
      "t_mem us",
      "t_flop us",
      "bound");
  out << line;
  double total_bytes = 0, total_flops = 0, total_time = 0;
  for (const Row& row : rows) {
    const Dispatch& d = *row.first;
    char groups[64];
    std::snprintf(
        groups,
        sizeof(groups),
        "%ux%ux%u",
        d.threadgroups.x,
        d.threadgroups.y,
        d.threadgroups.z);
    std::string stage = d.stage;
    if (row.count > 1)
      stage += " x" + std::to_string(row.count);
    std::snprintf(
        line,
        sizeof(line),
        "%-26s %-48s %18s %8llu %9zu %10.2f %11.3f %10.1f %10.1f %6s\n",
        stage.c_str(),
        d.kernel.c_str(),
        groups,
        (unsigned long long)d.threads_per_threadgroup.count(),
        d.threadgroup_memory_bytes,
        row.bytes / 1e6,
        row.flops / 1e9,
        row.t_mem,
        row.t_flop,
        row.t_mem > row.t_flop ? "memory" : "flops");
    out << line;
    total_bytes += row.bytes;
    total_flops += row.flops;
    total_time += row.time;
  }
  uint64_t scratch = 0;
  for (const BufferSpec& spec : plan.buffers) {
    if (spec.role == BufferRole::Scratch)
      scratch += spec.bytes;
  }
  std::snprintf(
      line,
      sizeof(line),
      "total: %.2f MB moved, %.3f GFLOP; roofline time (sum over stages of "
      "max(memory, flops)) %.1f us; scratch %.1f MiB\n",
      total_bytes / 1e6,
      total_flops / 1e9,
      total_time,
      scratch / 1048576.0);
  out << line;
  return out.str();
}

}  // namespace mlx_gated_delta::metal
