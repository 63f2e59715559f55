// The executor's shared pieces (launch.h).
#include "cuda/launch.h"

#include <algorithm>
#include <stdexcept>

#include "cuda/launch_shapes.h"
#include "cuda/module.h"
#include "mlx/allocator.h"
#include "mlx/backend/cuda/utils.h"

namespace mx = mlx::core;

namespace mlx_gated_delta::cuda {

namespace {

// Shared memory of chunk_prepare and chunk_carry (their layouts in
// chunk_prepare.cu and chunk_carry.cu).
int prepare_shared_bytes(const GatedDeltaParams& p) {
  const int kp = tile_stride(p.key_dim), vp = tile_stride(p.value_dim);
  const int lp = tile_stride(kChunk);
  const int sums = (kChunk / kTile - 1) * kTile * tile_stride(kTile);
  const int scalar = int(sizeof(float)) *
      (kChunk * kp + kChunk * std::max(kp, vp) + 2 * kChunk * lp + sums +
       7 * kChunk);
  // Per-key gates add the rows decayed relative to each row tile, and each
  // key column's cumulative log2 decays (floats) and last wipes (bytes), both
  // [kChunk][kp].
  const int columns = int(sizeof(float)) * kRelativeColumnRows * kp +
      (int(sizeof(float)) + 1) * kChunk * kp;
  return p.per_key_gates ? scalar + columns : scalar;
}
// chunk_carry's blocks and shared memory (sized for Dk up to kChunkedMaxDim).
dim3 carry_grid(const GatedDeltaParams& p) {
  return dim3(
      (p.value_dim + kCarryBlockRows - 1) / kCarryBlockRows,
      p.value_heads,
      p.batch);
}
constexpr int kCarrySharedBytes = int(sizeof(float)) * kCarrySharedFloats;

}  // namespace

const char* dtype_suffix(mx::Dtype dtype) {
  switch (dtype) {
    case mx::float32:
      return "f32";
    case mx::float16:
      return "f16";
    case mx::bfloat16:
      return "bf16";
    default:
      throw std::invalid_argument(
          "mlx_gated_delta: the CUDA kernels take float32, float16 or "
          "bfloat16 activations");
  }
}

bool chunked_kernels_cover(const GatedDeltaParams& p) {
  return !p.has_tree && p.key_dim <= kChunkedMaxDim &&
      p.value_dim <= kChunkedMaxDim;
}

mx::array scratch(mx::cu::CommandEncoder& encoder, int64_t floats) {
  floats = std::max<int64_t>(floats, 1);
  mx::array buffer(
      mx::allocator::malloc(size_t(floats) * sizeof(float)),
      {int(floats)},
      mx::float32);
  encoder.add_temporary(buffer);
  return buffer;
}

void set_arrays(
    mx::cu::CommandEncoder& encoder,
    const std::vector<mx::array>& reads,
    const std::vector<mx::array>& writes) {
  for (const auto& array : reads) {
    encoder.set_input_array(array);
  }
  for (const auto& array : writes) {
    encoder.set_output_array(array);
  }
}

void launch(
    mx::cu::CommandEncoder& encoder,
    const std::string& source,
    const std::string& name,
    dim3 grid,
    int threads,
    int shared_bytes,
    void** params) {
  encoder.device().make_current();
  encoder.add_kernel_node_raw(
      kernel(encoder.device().cuda_device(), source, name, shared_bytes),
      grid,
      dim3(threads),
      dim3(),
      shared_bytes,
      params);
}

CoreArgs input_args(
    const GatedDeltaParams& p, const std::vector<mx::array>& inputs) {
  CoreArgs a{};
  a.q = mx::gpu_ptr<void>(inputs[kQ]);
  a.k = mx::gpu_ptr<void>(inputs[kK]);
  a.v = mx::gpu_ptr<void>(inputs[kV]);
  a.g = mx::gpu_ptr<float>(inputs[kG]);
  a.beta = mx::gpu_ptr<float>(inputs[kBeta]);
  a.state_in = mx::gpu_ptr<float>(inputs[kState]);
  a.mask = p.has_mask ? mx::gpu_ptr<bool>(inputs[kMask]) : nullptr;
  a.batch = p.batch;
  a.tokens = p.tokens;
  a.key_heads = p.key_heads;
  a.value_heads = p.value_heads;
  a.key_dim = p.key_dim;
  a.value_dim = p.value_dim;
  a.scale = p.scale;
  a.grouped = p.head_mapping == HeadMapping::Grouped;
  a.normalize_qk = p.normalize_qk;
  a.per_key_gates = p.per_key_gates;
  a.checkpoint_count = p.checkpoint_count;
  return a;
}

ChunkForwardScratch chunk_forward_scratch(
    mx::cu::CommandEncoder& encoder, const GatedDeltaParams& p, bool keep_t) {
  const int64_t problems = int64_t(p.batch) * p.value_heads * p.num_chunks();
  // K is a key head's with scalar gates, a value head's with per-key gates
  // (kernel_args.h), and so is Q decayed, which only per-key gates need.
  const int64_t key_problems = p.per_key_gates
      ? problems
      : int64_t(p.batch) * p.key_heads * p.num_chunks();
  const int64_t key_rows = kChunk * tile_padded(p.key_dim);
  ChunkForwardScratch s;
  s.buffers = {
      scratch(encoder, problems * key_rows),
      scratch(encoder, problems * kChunk * tile_padded(p.value_dim)),
      scratch(encoder, problems * kChunk * kChunk),
      scratch(encoder, problems * kDecayRows * kChunk),
      scratch(encoder, problems * p.value_dim * p.key_dim),
      scratch(encoder, key_problems * key_rows),
      scratch(encoder, problems * kChunkedMaxDim),
      scratch(encoder, p.per_key_gates ? problems * key_rows : 0)};
  if (keep_t) {
    s.buffers.push_back(scratch(encoder, problems * kChunk * kChunk));
    s.buffers.push_back(
        scratch(encoder, p.per_key_gates ? problems * key_rows : 0));
  }
  s.pointers.w = mx::gpu_ptr<float>(s.buffers[0]);
  s.pointers.u = mx::gpu_ptr<float>(s.buffers[1]);
  s.pointers.qk = mx::gpu_ptr<float>(s.buffers[2]);
  s.pointers.decays = mx::gpu_ptr<float>(s.buffers[3]);
  s.pointers.h = mx::gpu_ptr<float>(s.buffers[4]);
  s.pointers.k = mx::gpu_ptr<float>(s.buffers[5]);
  s.pointers.column_decays = mx::gpu_ptr<float>(s.buffers[6]);
  s.pointers.q = mx::gpu_ptr<float>(s.buffers[7]);
  s.pointers.t = keep_t ? mx::gpu_ptr<float>(s.buffers[8]) : nullptr;
  s.pointers.k_from_start =
      keep_t && p.per_key_gates ? mx::gpu_ptr<float>(s.buffers[9]) : nullptr;
  return s;
}

void launch_prepare_and_carry(
    mx::cu::CommandEncoder& encoder,
    const GatedDeltaParams& p,
    const std::vector<mx::array>& inputs,
    const ChunkForwardScratch& scratch,
    const std::vector<mx::array>& carry_outputs,
    void** params) {
  const std::string dtype = dtype_suffix(inputs[kV].dtype());
  const std::vector<mx::array>& buffers = scratch.buffers;
  std::vector<mx::array> prepared = buffers;
  prepared.erase(prepared.begin() + 4);  // h is chunk_carry's
  set_arrays(encoder, inputs, prepared);
  launch(
      encoder,
      "chunk_prepare",
      "gd_chunk_prepare_" + dtype,
      dim3(p.num_chunks(), p.value_heads, p.batch),
      kChunkedThreads,
      prepare_shared_bytes(p),
      params);
  std::vector<mx::array> reads = inputs;
  reads.insert(reads.end(), buffers.begin(), buffers.end());
  std::vector<mx::array> writes = {buffers[1], buffers[4]};
  writes.insert(writes.end(), carry_outputs.begin(), carry_outputs.end());
  set_arrays(encoder, reads, writes);
  // The carry's K is exact as a tensor-core operand when it is the inputs'
  // float16 or bfloat16 rows; decayed per key column it is float32.
  launch(
      encoder,
      "chunk_carry",
      "gd_chunk_carry_" + (p.per_key_gates ? std::string("f32") : dtype),
      carry_grid(p),
      kChunkedThreads,
      kCarrySharedBytes,
      params);
}

}  // namespace mlx_gated_delta::cuda
