// The CUDA kernels' module: the fatbin compiled from csrc/cuda/*.cu and
// embedded in the extension, loaded through the CUDA driver on first use.
#pragma once

#include <cuda.h>

#include <string>

namespace mlx_gated_delta::cuda {

// The kernel `name` of the fatbin compiled from csrc/cuda/<source>.cu, for
// CUDA device `device` (whose context is current), allowed `shared_bytes` of
// dynamic shared memory. Throws with the driver's message if it cannot be
// loaded (a GPU the fatbin has no code for, say).
CUfunction kernel(
    int device,
    const std::string& source,
    const std::string& name,
    int shared_bytes);

// Moves the pages of the unified (managed) memory [data, data + bytes) to
// GPU `device`, ordered on `stream`, so that the kernels after it on the
// stream do not fault them in one by one: MLX's exported allocator hands out
// unified memory, and a buffer new to it has no pages on the GPU yet.
void prefetch_to_device(
    int device, const void* data, size_t bytes, CUstream stream);

}  // namespace mlx_gated_delta::cuda
