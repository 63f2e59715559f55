// Where a GPU call runs that has no kernels on the GPU backend MLX was built
// with.
#pragma once

#include "mlx/stream.h"

namespace mlx_gated_delta {

// On a CUDA build of MLX (CMake option MLX_GATED_DELTA_CUDA), a call that the
// CUDA kernels do not cover (docs/cuda.md) runs on the CPU stream instead of
// the GPU stream: MLX orders the two streams and the CPU kernels read the
// GPU's buffers, so the results are the CPU's. Elsewhere the stream is kept
// (Metal has kernels for every stage; the Linux CPU build runs GPU calls
// nowhere).
inline mlx::core::Stream cpu_unless_cuda_kernels(
    mlx::core::Stream stream, [[maybe_unused]] bool has_cuda_kernels) {
#ifdef MLX_GATED_DELTA_CUDA
  if (stream.device == mlx::core::Device::gpu && !has_cuda_kernels) {
    return mlx::core::default_stream(mlx::core::Device::cpu);
  }
#endif
  return stream;
}

}  // namespace mlx_gated_delta
