// The CUDA executor of the core op (built only against a CUDA build of MLX,
// CMake option MLX_GATED_DELTA_CUDA): records the kernels of one call into
// the command encoder of an MLX CUDA stream (docs/cuda.md).
#pragma once

#include <vector>

#include "core/core_params.h"
#include "mlx/array.h"
#include "mlx/stream.h"
#include "segment/segment_params.h"

namespace mlx_gated_delta::cuda {

// Whether the CUDA kernels cover this call; the op runs the others on the
// CPU stream (docs/cuda.md): key dims over 256.
bool has_core_kernels(const GatedDeltaParams& params);

// The algorithm "auto" runs on CUDA: the chunked form from one chunk of
// tokens on, for scalar gates, no tree and dims the chunked kernels cover;
// the recurrent form otherwise. An explicit "chunked" that the chunked
// kernels do not cover runs the recurrent kernel (the same function, within
// the same contract).
Algorithm resolve_cuda_algorithm(
    const GatedDeltaParams& params, Algorithm requested);

// inputs: q, k, v, g, beta, state [, mask] [, checkpoints] [, parents];
// outputs: y, state [, checkpoint states].
void eval_core(
    const GatedDeltaParams& params,
    Algorithm algorithm,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    const mlx::core::Stream& stream);

// Whether the CUDA backward covers this call (recurrent_backward.cu): scalar
// gates, key and value dims up to 128; the op runs the others on the CPU
// stream.
bool has_backward_kernels(const GatedDeltaParams& params);

// The backward algorithm "auto" runs on CUDA: the chunked WY form
// (chunk_backward.cu, chunk_wy_backward.cu) from one chunk of tokens on, for
// scalar gates and dims the chunked kernels cover, the recurrent form
// (recurrent_backward.cu) otherwise; an explicit "chunked" that the chunked
// kernels do not cover (per-key gates) runs the recurrent form, within the
// same gradient contracts.
Algorithm resolve_cuda_backward_algorithm(
    const GatedDeltaParams& params, Algorithm requested);

// The backward of the core op, in the form resolve_cuda_backward_algorithm
// picks for `algorithm`.
// inputs: q, k, v, g, beta, state [, mask], the cotangents of y and of the
// final state; outputs: dq, dk, dv, dg, dgamma, dbeta, dstate.
void eval_backward(
    const GatedDeltaParams& params,
    Algorithm algorithm,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    const mlx::core::Stream& stream);

// Whether the CUDA kernels cover this segment call: the segment's own
// stages cover every shape, the core's kernels key dims up to 256 (the op
// runs the others as MLX ops around the core op, segment_ops.h).
bool has_segment_kernels(const SegmentParams& params);

// The fused segment (segment.cu): prepare_conv, prepare_gates and
// collect_conv_state (with its checkpoints), the core's kernels as eval_core
// runs them (`algorithm` resolved as there), then gated_norm.
// inputs and outputs: GatedDeltaSegment's (segment/segment_primitive.h).
void eval_segment(
    const SegmentParams& params,
    Algorithm algorithm,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    const mlx::core::Stream& stream);

}  // namespace mlx_gated_delta::cuda
