// A GPU call on MLX's CUDA backend that our CUDA kernels do not cover.
#pragma once

#include <stdexcept>
#include <string>

#include "mlx/stream.h"

namespace mlx_gated_delta {

// On a CUDA build of MLX (CMake option MLX_GATED_DELTA_CUDA) a call on the
// GPU that the CUDA kernels do not cover (`gap`, from cuda/executor.h: what
// they lack, empty when they cover it) raises a ValueError when the op is
// called, naming the call, the device and the alternative. It does not run
// on the CPU instead: no backend falls back silently to another.
inline void require_cuda_kernels(
    const mlx::core::Stream& stream,
    const std::string& call,
    const std::string& gap) {
  if (stream.device == mlx::core::Device::gpu && !gap.empty()) {
    throw std::invalid_argument(
        "mlx_gated_delta: " + call +
        " on the GPU (MLX's CUDA backend) has no CUDA kernel for " + gap +
        "; run it on the CPU (stream=mx.cpu).");
  }
}

}  // namespace mlx_gated_delta
