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

// y[rows, out] = x[rows, in] * weight[out, in]^T; all row-major, contiguous.
template <typename T>
void dense_projection_forward(
    int64_t rows,
    int in_features,
    int out_features,
    const T* x,
    const T* weight,
    T* y);

}  // namespace mlx_gated_delta::cpu
