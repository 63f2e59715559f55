// The CUDA executor of the core op (built only against a CUDA build of MLX,
// CMake option MLX_GATED_DELTA_CUDA): records the kernels of one call into
// the command encoder of an MLX CUDA stream (docs/cuda.md).
#pragma once

#include <string>
#include <vector>

#include "core/core_params.h"
#include "mlx/array.h"
#include "mlx/stream.h"
#include "segment/segment_params.h"

namespace mlx_gated_delta::cuda {

// What the CUDA kernels lack to run this call (key dims over 256), as the end
// of the error the op raises on a CUDA stream (core/cuda_coverage.h); empty
// when they cover it. The fused segment's own stages cover every shape: its
// calls are covered where its core's are.
std::string core_kernels_gap(const GatedDeltaParams& params);

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

// What the CUDA backward lacks to run this call, as core_kernels_gap: key
// dims over 256, or over 224 with per-key gates (recurrent_backward.cu's
// staged chunk in shared memory; launch_shapes.h's backward_max_key_dim).
std::string backward_kernels_gap(const GatedDeltaParams& params);

// The backward algorithm "auto" runs on CUDA: the chunked WY form
// (chunk_backward.cu, chunk_wy_backward.cu) from one chunk of tokens on
// where its per-chunk blocks fill the GPU (kChunkedBackwardMinBlocks) and
// the chunked kernels cover the dims, the recurrent form
// (recurrent_backward.cu) otherwise; an explicit "chunked" that the chunked
// kernels do not cover (a tree, dims over 128) runs the recurrent form,
// within the same gradient contracts.
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
