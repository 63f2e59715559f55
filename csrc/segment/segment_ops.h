// The segment's stages as MLX ops, on any stream.
//
// Two users: the segment's backward on streams without segment kernels
// (segment_vjp.cpp) recomputes the core's inputs with them, and on MLX's CUDA
// backend, where the core op has kernels and the segment's own stages do not,
// the whole forward is these ops around the core op (segment_as_ops). Same
// math as the CPU and Metal kernels (docs/contract.md): the conv with the skip
// semantics of the mask, SiLU, the gates and the gated RMSNorm in float32.
#pragma once

#include <array>
#include <functional>
#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/stream.h"
#include "segment/segment_params.h"

namespace mlx_gated_delta {

const char* head_mapping_name(HeadMapping mapping);
const char* algorithm_name(Algorithm algorithm);

// Rows `rows` ([B, n], indices into each batch row of `a` [B, L, W]) of `a`,
// as [B, n, W].
mlx::core::array take_rows(
    const mlx::core::array& a,
    const mlx::core::array& rows,
    mlx::core::Stream s);

// The conv's positions under the skip semantics of the mask. The conv runs
// over "compact" positions of each row: compact position c < K-1 is conv
// state row c, and compact position K-1+r is the r-th unmasked token. Masked
// tokens have no compact position, so they enter no conv window. Without a
// mask, compact positions are the rows of ext = [conv_state; tokens].
struct CompactPositions {
  // Unmasked tokens before each token ([B, T], int32): token t's conv output
  // is the compact conv's row rank[t].
  mlx::core::array rank;
  // Unmasked tokens per row ([B, 1], int32).
  mlx::core::array count;
  // With a mask only: the ext row of each compact position ([B, K-1+T];
  // positions past the row's K-1+count read a real row, which no kept token
  // uses), and the compact position of each ext row with whether it has one.
  std::optional<mlx::core::array> ext_of_compact;
  std::optional<mlx::core::array> compact_of_ext;
  std::optional<mlx::core::array> ext_is_kept;
  // With a mask only: the token of each rank ([B, T]; ranks past the count
  // name token 0) and whether the rank is below the count.
  std::optional<mlx::core::array> token_of_rank;
  std::optional<mlx::core::array> rank_is_kept;
};

CompactPositions compact_positions(
    const SegmentParams& p,
    const std::optional<mlx::core::array>& mask,
    mlx::core::Stream s);

// One part (q, k or v) of the conv: the channels [first, first + width).
struct ConvPart {
  mlx::core::array
      compact;  // [B, K-1+T, W], activation dtype: the conv's input
  mlx::core::array
      pre;  // [B, T, W] float32: the conv output before SiLU, per token
  mlx::core::array weight;  // [W, K] float32
};

// The first channel and the width of the conv parts q, k and v.
std::array<int, 3> conv_part_firsts(const SegmentParams& p);
std::array<int, 3> conv_part_widths(const SegmentParams& p);

// The segment's inputs in SegmentInput order (segment_primitive.h).
ConvPart conv_part_forward(
    const SegmentParams& p,
    const CompactPositions& at,
    const std::vector<mlx::core::array>& primals,
    int first,
    int width,
    mlx::core::Stream s);

// The slice [first, first + width) of every packed row, as float32.
mlx::core::array mixed_columns(
    const SegmentParams& p,
    const mlx::core::array& mixed,
    int first,
    int width,
    mlx::core::Stream s);

// The core recurrence of the segment, as a function of its inputs
// {q, k, v, g, beta, state}.
std::function<
    std::vector<mlx::core::array>(const std::vector<mlx::core::array>&)>
core_function(
    const SegmentParams& p,
    Algorithm algorithm,
    const std::optional<mlx::core::array>& mask,
    mlx::core::Stream s);

// The stages before the recurrence: the conv parts, SiLU and the gates, and
// from them the core's inputs {q, k, v, g, beta, state}. g = rate softplus(u),
// or lower_bound sigmoid(-rate u) with a lower bound, u = a + dt_bias; beta =
// sigmoid(b), twice that with allow_neg_eigval. Per key channel, u and g are
// [B, T, Hv, Dk] and the rate [Hv, 1].
struct CoreInputs {
  CompactPositions at;
  std::vector<ConvPart> parts;  // q, k, v
  mlx::core::array rate;  // [Hv] (per key: [Hv, 1]) float32: the decay rate
  mlx::core::array gate_input;  // [B, T, Hv] (per key: [B, T, Hv, Dk]): u
  mlx::core::array decay_sigmoid;  // sigmoid(u), or sigmoid(-rate u) bounded
  mlx::core::array softplus;  // softplus(u)
  mlx::core::array b_sigmoid;  // [B, T, Hv] float32: sigmoid(b)
  std::vector<mlx::core::array> core_primals;
};

CoreInputs core_inputs(
    const SegmentParams& p,
    const std::optional<mlx::core::array>& mask,
    const std::vector<mlx::core::array>& primals,
    mlx::core::Stream s);

// The whole forward of the segment as MLX ops around the core op, with the
// outputs of the GatedDeltaSegment primitive: {out, conv_state, state} and,
// with checkpoint positions, the conv states and states after them.
std::vector<mlx::core::array> segment_as_ops(
    const SegmentParams& p,
    Algorithm algorithm,
    const std::vector<mlx::core::array>& primals,
    const std::optional<mlx::core::array>& mask,
    const std::vector<int>& checkpoints,
    mlx::core::Stream s);

}  // namespace mlx_gated_delta
