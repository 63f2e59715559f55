// What the CUDA executor's forward (executor.cpp) and backward
// (executor_backward.cpp) share: the inputs' layout, scratch from MLX's
// allocator, kernel launches into the encoder's graph, and the chunked
// forward's first two kernels, which the chunked backward reruns.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/core_params.h"
#include "cuda/kernel_args.h"
#include "mlx/array.h"
#include "mlx/backend/cuda/device.h"

namespace mlx_gated_delta::cuda {

// The core op's inputs, in the primitive's order.
enum CoreInput { kQ = 0, kK, kV, kG, kBeta, kState, kMask };

// The kernels' name suffix of an activation dtype ("f32", "f16", "bf16").
const char* dtype_suffix(mlx::core::Dtype dtype);

// Whether the chunked kernels, forward and backward, take this call: no
// tree, key and value dims up to kChunkedMaxDim.
bool chunked_kernels_cover(const GatedDeltaParams& p);

// A float32 scratch buffer from MLX's allocator, kept alive until the
// encoder's graph has run; at least one float, so that an empty scratch (a
// call of no tokens) still has an address to pass.
mlx::core::array scratch(
    mlx::core::cu::CommandEncoder& encoder, int64_t floats);

// The encoder orders graph nodes by the buffers they read and write: each
// kernel names its own, the scratch included, just before it is added.
void set_arrays(
    mlx::core::cu::CommandEncoder& encoder,
    const std::vector<mlx::core::array>& reads,
    const std::vector<mlx::core::array>& writes);

// Adds kernel `name` of the fatbin of `source` (module.h) to the graph.
void launch(
    mlx::core::cu::CommandEncoder& encoder,
    const std::string& source,
    const std::string& name,
    dim3 grid,
    int threads,
    int shared_bytes,
    void** params);

// The inputs and dims that the forward and the backward read alike.
CoreArgs input_args(
    const GatedDeltaParams& p, const std::vector<mlx::core::array>& inputs);

// The chunked forward's scratch, ChunkScratch's order: w, u (then v'), qk,
// decays, h, k, column_decays, q, and with `keep_t` (the backward's rerun)
// t.
struct ChunkForwardScratch {
  std::vector<mlx::core::array> buffers;
  ChunkScratch pointers{};
};
ChunkForwardScratch chunk_forward_scratch(
    mlx::core::cu::CommandEncoder& encoder,
    const GatedDeltaParams& p,
    bool keep_t);

// chunk_prepare (everything of the scratch but h), then chunk_carry (v' over
// u, h, and `carry_outputs`: the final state and the checkpoints); `params`
// points at the CoreArgs and the ChunkScratch.
void launch_prepare_and_carry(
    mlx::core::cu::CommandEncoder& encoder,
    const GatedDeltaParams& p,
    const std::vector<mlx::core::array>& inputs,
    const ChunkForwardScratch& scratch,
    const std::vector<mlx::core::array>& carry_outputs,
    void** params);

}  // namespace mlx_gated_delta::cuda
