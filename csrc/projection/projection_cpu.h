// The layer's dense projections on the CPU: y = x W^T (nn.Linear's product,
// with W in its [out, in] layout), float32 accumulation.
//
// MLX's CPU matmul reaches about 1 GFLOP/s on the machines measured here,
// which made the input and output projections, not the recurrence, the cost
// of a whole Gated DeltaNet layer. This reuses the core's register-tiled
// small GEMM (cpu/small_gemm.h) on blocks of W packed once per call.
#pragma once

#include <cstdint>

namespace mlx_gated_delta::cpu {

// A matrix operand: element (i, j) at data[i * row_stride + j * column_stride].
// The vjp passes dy^T, x^T and W^T this way, as transposed views of their
// row-major buffers, instead of copying each into row-major order (dy^T is as
// large as the projected row: 193 MiB for Qwen3-Next's layer at T = 8192).
template <typename T>
struct MatrixView {
  const T* data;
  int64_t row_stride;
  int64_t column_stride;
};

// y[rows, out] = x[rows, in] * weight[out, in]^T; y row-major, row r at
// y + r * y_row_stride (>= out: a projection of several writes its outputs
// side by side into one row, DenseProjection in projection_op.h).
template <typename T>
void dense_projection_forward(
    int64_t rows,
    int in_features,
    int out_features,
    MatrixView<T> x,
    MatrixView<T> weight,
    T* y,
    int64_t y_row_stride);

}  // namespace mlx_gated_delta::cpu
