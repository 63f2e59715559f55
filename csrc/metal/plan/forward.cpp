// The forward's stages (builder.h) and make_plan: the recurrent kernel, or
// the chunked (WY) form's stages from qk_norm to chunk_output.
#include <stdexcept>

#include "metal/plan/builder.h"
#include "validation/extents.h"

namespace mlx_gated_delta::metal {

namespace {

// Threadgroup memory each kernel declares (its `threadgroup` arrays), from the
// layout constants of kernel_abi.h the kernels size them with.
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
// key_decayed_grams: its four staging blocks for the pairs, and its factored
// rows and columns for the products, reuse the two dot-product tiles of
// kkt_inverse and chunk_qk; each thread keeps a whole number of the diagonal
// blocks' entries; the products step 8 columns at a time.
constexpr size_t kSubChunks = kChunkSize / kSubChunkSize;
constexpr size_t kFactoredRows = (kChunkSize - kSubChunkSize) +
    kSubChunkSize * kSubChunks * (kSubChunks - 1) / 2;
static_assert(4 * kKeyDecayTileWidth <= 2 * kDotTileWidth);
static_assert(
    kFactoredRows * kKeyDecayTileWidth <= 2 * kChunkSize * kDotTileWidth);
static_assert(kSubChunks * kSubChunkSize * kSubChunkSize % kChunkThreads == 0);
static_assert(kKeyDecayTileWidth % 8 == 0 && kSubChunkSize % 8 == 0);

// key_decayed_grams' flops per chunk of one value head, Dk channels: the
// products left of the diagonal blocks (2 Dk per entry: 16 rows by 16, 32
// and 48 columns), their factored rows and columns (an exp, a subtraction
// and a product per channel) and the diagonal blocks' 4 x 136 pairs (four
// flops and an exp per pair and channel).
double key_decayed_grams_flops(double Dk) {
  const double left_entries =
      double(kSubChunkSize) * kSubChunkSize * kSubChunks * (kSubChunks - 1) / 2;
  const double diagonal_pairs =
      double(kSubChunks) * kSubChunkSize * (kSubChunkSize + 1) / 2;
  return (2.0 * left_entries + 3.0 * kFactoredRows + 5.0 * diagonal_pairs) * Dk;
}
constexpr size_t kRecomputeWuBytes = kChunkTileBytes + 2 * kChunkSize * kFloat;
constexpr size_t kChunkCarryBytes = (kCarryRows * kMaxChunkedKeyDim +
                                     kCarryRows * kChunkSize + 2 * kChunkSize) *
    kFloat;
constexpr size_t kChunkOutputBytes = kChunkTileBytes;

}  // namespace

void PlanBuilder::core() {
  if (plan.algorithm == Algorithm::Recurrent) {
    recurrent();
    return;
  }
  chunked_through_carry();
  chunk_output();
}

void PlanBuilder::chunked_through_carry() {
  if (p.normalize_qk)
    qk_norm();
  gate_cumsum();
  if (uses_k_gram())
    k_gram();
  kkt_inverse();
  recompute_w_u();
  chunk_qk();
  chunk_carry();
}

void PlanBuilder::recurrent() {
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
void PlanBuilder::chunked_scratch() {
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
  // Per-key gates: the cumulative log decay per key channel, [B, Hv, C, 64,
  // Dk], and a 64-bit wipe mask per chunk and key channel, [B, Hv, C, Dk].
  const uint64_t gate_rows = B * Hv * padded_tokens * uint64_t(p.gate_width());
  add_scratch(GateCumsum, "gate cumsum elements", gate_rows, 4);
  add_scratch(WipeMask, "wipe mask elements", gate_rows / kChunkSize, 8);
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

void PlanBuilder::qk_norm() {
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

void PlanBuilder::gate_cumsum() {
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
       {4, WipeMask},
       {5, BetaEffective},
       {7, TinyDecayMask}},
      6,
      {GateCumsum, WipeMask, BetaEffective, TinyDecayMask});
  const double width = p.gate_width();
  // The chunked backward's rerun also writes the tiny-decay mask (a word per
  // chunk and channel).
  const double tiny_decay_bytes =
      plan.buffer_bytes(TinyDecayMask) > 0 ? C * 8.0 * width : 0.0;
  d.bytes_moved = B * T * Hv * (width + 1) * 4.0 +
      B * T * (p.has_mask ? 1 : 0) +
      B * Hv *
          (decay_bytes_per_head(width) + padded_tokens * 4.0 +
           tiny_decay_bytes);
  d.flops = B * T * Hv * width;
}

void PlanBuilder::k_gram() {
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

void PlanBuilder::kkt_inverse() {
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
           {4, WipeMask},
           {5, BetaEffective},
           {6, KktInverse}},
          7,
          {KktInverse});
  // Gram (read, or built from K), the decays and beta, then the
  // triangular solve (about 64^3 / 3 flops per chunk); T written whole.
  // Per-key gates: the decayed gram (key_decayed_grams), from K and the
  // per-channel decays.
  double gram_bytes =
      k_gram ? B * Hv * chunk_tiles() * 4.0 : B * Hv * T * Dk * double(e);
  double gram_flops = k_gram ? 0.0 : 2.0 * tile() * Dk;
  if (p.per_key_gates) {
    gram_bytes += B * Hv * decay_bytes_per_head(Dk);
    gram_flops = key_decayed_grams_flops(Dk);
  }
  d.bytes_moved = gram_bytes +
      B * Hv * (padded_tokens * 4.0 + decay_bytes_per_head(1)) +
      B * Hv * chunk_tiles() * 4.0;
  d.flops = B * Hv * C * (gram_flops + 3 * tile() + tile() * kChunkSize / 3);
}

void PlanBuilder::recompute_w_u() {
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
           {4, WipeMask},
           {5, BetaEffective},
           {6, KktInverse},
           {7, W},
           {8, U}},
          9,
          {W, U});
  // Per-key gates: K is decayed per channel, from the channels' decays.
  d.bytes_moved = B * Hv *
      (T * (Dk + Dv) * double(e) + chunk_tiles() * 4.0 +
       padded_tokens * (Dk + Dv) * 4.0 +
       (p.per_key_gates ? decay_bytes_per_head(Dk) : 0.0));
  d.flops = 2.0 * B * Hv * C * (tile() / 2) * (Dk + Dv);
}

void PlanBuilder::chunk_qk() {
  using enum PlanBuffer;
  std::vector<std::pair<unsigned, PlanBuffer>> bindings = {
      {0, Query},
      {1, Key},
      {2, QueryInverseNorm},
      {3, KeyInverseNorm},
      {4, QK}};
  if (p.per_key_gates) {
    bindings.insert(bindings.end(), {{6, GateCumsum}, {7, WipeMask}});
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
  // Per-key gates: one decayed tile per value head (key_decayed_grams),
  // reading the channels' decays.
  const double heads = double(qk_heads());
  d.bytes_moved = B * heads *
      (2.0 * T * Dk * double(e) + chunk_tiles() * 4.0 +
       (p.per_key_gates ? decay_bytes_per_head(Dk) : 0.0));
  d.flops = p.per_key_gates ? B * heads * C * key_decayed_grams_flops(Dk)
                            : 2.0 * B * heads * C * tile() * Dk;
}

void PlanBuilder::chunk_carry() {
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
           {5, WipeMask},
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
  // U and writes v' and the inter-chunk output; the state once each way;
  // per-key gates, the channels' decays.
  d.bytes_moved = B * Hv *
      (padded_tokens * (Dk + 3 * Dv) * 4.0 + 2 * T * Dk * double(e) +
       (2 + p.checkpoint_count) * Dv * Dk * 4.0 +
       (p.per_key_gates ? decay_bytes_per_head(Dk) : 0.0));
  // Per token and state row: v' (W S^T), the inter-chunk readout (S q)
  // and the state update (sum_j v'_j k_j^T): three Dk-long dot products;
  // a checkpoint cut in a chunk is at most one more update.
  d.flops = 6.0 * B * Hv * T * Dk * Dv +
      2.0 * p.checkpoint_count * B * Hv * kChunkSize * Dk * Dv;
}

void PlanBuilder::chunk_output() {
  using enum PlanBuffer;
  Dispatch& d =
      add("chunk_output",
          core_kernel("chunk_output"),
          {unsigned(C), unsigned(Hv), unsigned(B)},
          kChunkThreads,
          kChunkOutputBytes,
          {{0, QK},
           {1, GateCumsum},
           {2, WipeMask},
           {3, Mask},
           {4, U},
           {5, OutputInter},
           {6, Output}},
          7,
          {Output});
  d.bytes_moved = B * Hv *
      (chunk_tiles() * 4.0 + padded_tokens * 2 * Dv * 4.0 +
       (p.per_key_gates ? 0.0 : decay_bytes_per_head(1)) + T * Dv * double(e));
  d.flops = 2.0 * B * Hv * C * (tile() / 2) * Dv;
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

}  // namespace mlx_gated_delta::metal
