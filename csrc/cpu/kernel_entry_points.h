// The entry points of one compiled copy of the CPU kernels, in its level's
// namespace (kernel_level.h). A kernel source sees its own copy's: it is
// compiled with MLX_GATED_DELTA_KERNEL_LEVEL naming its level. kernel_level.cpp
// includes this file once per level of the build, so it has no include guard.
// Each function does what its namesake in namespace mlx_gated_delta::cpu does
// (forward.h, backward.h, segment.h, projection_cpu.h).

#include <cstdint>

#include "cpu/backward.h"
#include "cpu/forward.h"
#include "cpu/segment.h"
#include "projection/projection_cpu.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

template <typename T>
void gated_delta_forward(
    const GatedDeltaParams& params,
    Algorithm algorithm,
    const CoreBuffers<T>& buffers);

ChunkedTrace trace_chunked_stages(
    const GatedDeltaParams& params,
    const CoreBuffers<float>& buffers,
    int batch,
    int head);

template <typename T>
void gated_delta_backward(
    const GatedDeltaParams& params,
    Algorithm algorithm,
    const BackwardBuffers<T>& buffers);

ChunkedBackwardTrace trace_chunked_backward_stages(
    const GatedDeltaParams& params,
    const BackwardBuffers<float>& buffers,
    int batch,
    int head);

template <typename T>
void gated_delta_segment_forward(
    const SegmentParams& params,
    Algorithm algorithm,
    const SegmentBuffers<T>& buffers);

template <typename T>
void gated_delta_segment_backward(
    const SegmentParams& params,
    Algorithm forward,
    Algorithm backward,
    const SegmentBackwardBuffers<T>& buffers);

template <typename T>
void dense_projection_forward(
    int64_t rows,
    int in_features,
    int out_features,
    MatrixView<T> x,
    MatrixView<T> weight,
    T* y,
    int64_t y_row_stride);

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
