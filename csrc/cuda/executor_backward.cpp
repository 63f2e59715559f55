// The CUDA executor's backward: the chunked WY form and the recurrent
// form's reverse, then qk_grad_reduce (docs/cuda.md); kernels recorded into
// the CUDA graph of MLX's command encoder, as the forward's (executor.cpp).
#include <algorithm>
#include <string>

#include "cuda/executor.h"
#include "cuda/kernel_args.h"
#include "cuda/launch.h"
#include "cuda/launch_shapes.h"
#include "mlx/allocator.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"

namespace mx = mlx::core;

namespace mlx_gated_delta::cuda {

namespace {

// Shared memory of the chunked backward's kernels (their layouts in
// chunk_backward.cu and chunk_wy_backward.cu).
int output_backward_shared_bytes(const GatedDeltaParams& p) {
  return int(sizeof(float)) * kChunk *
      (tile_stride(kChunk) + tile_stride(p.value_dim) + tile_stride(p.key_dim) +
       2);
}
int carry_backward_shared_bytes(const GatedDeltaParams& p) {
  const int kp = tile_stride(p.key_dim), rp = tile_stride(kCarryRows);
  return int(sizeof(float)) *
      (2 * kCarryRows * kp + 2 * kChunk * kp + 3 * kChunk * rp +
       kDecayRows * kChunk + kChunkedMaxDim);
}
int state_products_shared_bytes(const GatedDeltaParams& p) {
  const int slice_tiles =
      (tile_padded(p.key_dim) / kTile + kStateSlices - 1) / kStateSlices;
  const int sp = slice_tiles * kTile + kTileSkew;
  const int vp = tile_stride(p.value_dim);
  return int(sizeof(float)) *
      (tile_padded(p.value_dim) * sp + 2 * kChunk * vp + kChunkedThreads / 32);
}
// chunk_qk_backward and chunk_wy_backward: two row buffers, two [L, L]
// ones, the decays and two (four) rows of scalars.
int qk_backward_shared_bytes(const GatedDeltaParams& p) {
  const int xp = std::max(tile_stride(p.key_dim), tile_stride(p.value_dim));
  return int(sizeof(float)) * kChunk *
      (2 * xp + 2 * tile_stride(kChunk) + kDecayRows + 2);
}
int wy_backward_shared_bytes(const GatedDeltaParams& p) {
  const int xp = std::max(tile_stride(p.key_dim), tile_stride(p.value_dim));
  return int(sizeof(float)) * kChunk *
      (2 * xp + 2 * tile_stride(kChunk) + kDecayRows + 4);
}
// channel_pairs_backward (per-key gates): dM and dA, five rows of a float a
// key channel, four rows of scalars.
int channel_pairs_shared_bytes(const GatedDeltaParams& p) {
  return int(sizeof(float)) * kChunk *
      (2 * tile_stride(kChunk) + 5 * tile_padded(p.key_dim) + 4);
}

}  // namespace

std::string backward_kernels_gap(const GatedDeltaParams& p) {
  const int most = backward_max_key_dim(p.per_key_gates);
  if (p.key_dim <= most) {
    return "";
  }
  return "key dim " + std::to_string(p.key_dim) +
      (p.per_key_gates ? " with per-key gates" : "") +
      " (the backward takes key dims up to " +
      std::to_string(backward_max_key_dim(false)) + ", " +
      std::to_string(backward_max_key_dim(true)) + " with per-key gates)";
}

// "auto" takes the chunked backward where it has at least this many (batch
// row, value head, chunk) blocks: fewer leave most of the GPU idle in each of
// its kernels, while the recurrent backward spreads a head's state rows over
// blocks. Measured on an H200 and an H100 (docs/cuda.md, "Where the chunked
// backward pays"), the recurrent backward's time over the chunked one's with
// 32 value heads: scalar gates 0.61-0.63 at 32 blocks (B = 1, T = 64) and
// 0.99-1.10 at 64; per-key gates 0.75-0.83 at 64 blocks and 1.19-1.40 at
// 128.
constexpr int64_t kChunkedBackwardMinBlocks = 64;
constexpr int64_t kChunkedBackwardMinBlocksPerKey = 128;

Algorithm resolve_cuda_backward_algorithm(
    const GatedDeltaParams& p, Algorithm requested) {
  if (!chunked_kernels_cover(p) || p.key_dim == 0 || p.value_dim == 0) {
    return Algorithm::Recurrent;
  }
  if (requested == Algorithm::Auto) {
    const int64_t blocks = int64_t(p.batch) * p.value_heads * p.num_chunks();
    const int64_t least = p.per_key_gates ? kChunkedBackwardMinBlocksPerKey
                                          : kChunkedBackwardMinBlocks;
    return p.tokens >= kChunk && blocks >= least ? Algorithm::Chunked
                                                 : Algorithm::Recurrent;
  }
  return requested;
}

namespace {

// The chunked backward (chunk_backward.cu, chunk_wy_backward.cu): the
// forward's chunk_prepare (keeping T) and chunk_carry rerun for the chunks'
// entry states, W, V', M and T; chunk_output_backward, chunk_carry_backward
// (the sequential pass), chunk_state_products, chunk_qk_backward and
// chunk_wy_backward; then
// qk_grad_reduce, as the recurrent form's. Returns the partial sums' buffer,
// which qk_grad_reduce reads next.
mx::array eval_chunked_backward(
    const GatedDeltaParams& p,
    mx::cu::CommandEncoder& encoder,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    CoreArgs& a,
    BackwardArgs& o) {
  enum Output { kDq = 0, kDk, kDv, kDg, kDgamma, kDbeta, kDstate };
  const int chunks = p.num_chunks();
  const int64_t problems = int64_t(p.batch) * p.value_heads * chunks;
  const int64_t key_rows = problems * kChunk * tile_padded(p.key_dim);
  const int64_t value_rows = problems * kChunk * tile_padded(p.value_dim);
  // The forward's scratch, T kept, and its final state, which nothing reads.
  ChunkForwardScratch forward = chunk_forward_scratch(encoder, p, true);
  ChunkScratch& s = forward.pointers;
  mx::array final_state = scratch(
      encoder, int64_t(p.batch) * p.value_heads * p.value_dim * p.key_dim);
  a.state_out = mx::gpu_ptr<float>(final_state);
  // dv, ds, dq, dk, dw, state_dots (ChunkBackwardScratch's order), each
  // token's sums of a value head (BackwardArgs::partials, one block), then
  // ChunkBackwardScratch's pairs, ends and da (per-key gates).
  std::vector<mx::array> backward = {
      scratch(encoder, value_rows),
      scratch(
          encoder,
          problems * tile_padded(p.value_dim) * tile_padded(p.key_dim)),
      scratch(encoder, key_rows),
      scratch(encoder, key_rows),
      scratch(encoder, key_rows),
      scratch(
          encoder,
          problems * (p.per_key_gates ? tile_padded(p.key_dim) : kStateSlices)),
      scratch(
          encoder,
          int64_t(p.batch) * p.tokens * p.value_heads *
              backward_partial_width(p.key_dim, p.per_key_gates)),
      scratch(encoder, problems * kChunk * kChunk),
      scratch(encoder, problems * 2 * kChunk),
      scratch(encoder, p.per_key_gates ? problems * kChunk * kChunk : 0)};
  ChunkBackwardScratch d;
  d.dv = mx::gpu_ptr<float>(backward[0]);
  d.ds = mx::gpu_ptr<float>(backward[1]);
  d.dq = mx::gpu_ptr<float>(backward[2]);
  d.dk = mx::gpu_ptr<float>(backward[3]);
  d.dw = mx::gpu_ptr<float>(backward[4]);
  d.state_dots = mx::gpu_ptr<float>(backward[5]);
  o.partials = mx::gpu_ptr<float>(backward[6]);
  d.pairs = mx::gpu_ptr<float>(backward[7]);
  d.ends = mx::gpu_ptr<float>(backward[8]);
  d.da = p.per_key_gates ? mx::gpu_ptr<float>(backward[9]) : nullptr;
  o.partial_blocks = 1;

  const std::string dtype = dtype_suffix(inputs[kV].dtype());
  const int row_tiles = (p.value_dim + kCarryRows - 1) / kCarryRows;
  void* forward_params[] = {&a, &s};
  launch_prepare_and_carry(
      encoder, p, inputs, forward, {final_state}, forward_params);
  std::vector<mx::array> reads = inputs;
  reads.insert(reads.end(), forward.buffers.begin(), forward.buffers.end());

  void* params[] = {&a, &o, &s, &d};
  auto stage = [&](const char* source,
                   const std::string& name,
                   const std::vector<mx::array>& writes,
                   dim3 grid,
                   int shared_bytes) {
    std::vector<mx::array> stage_reads = reads;
    stage_reads.insert(stage_reads.end(), backward.begin(), backward.end());
    set_arrays(encoder, stage_reads, writes);
    launch(
        encoder,
        source,
        "gd_" + name + "_" + dtype,
        grid,
        kChunkedThreads,
        shared_bytes,
        params);
  };
  const dim3 per_chunk(chunks, p.value_heads, p.batch);
  stage(
      "chunk_backward",
      "chunk_output_backward",
      {backward[0], backward[1]},
      per_chunk,
      output_backward_shared_bytes(p));
  stage(
      "chunk_backward",
      "chunk_carry_backward",
      {backward[0], backward[1], outputs[kDstate]},
      dim3(row_tiles, p.value_heads, p.batch),
      carry_backward_shared_bytes(p));
  stage(
      "chunk_backward",
      "chunk_state_products",
      {backward[2], backward[3], backward[4], backward[5]},
      dim3(chunks * kStateSlices, p.value_heads, p.batch),
      state_products_shared_bytes(p));
  stage(
      "chunk_qk_backward",
      "chunk_qk_backward",
      {backward[2], backward[3], backward[6], backward[7], backward[8]},
      per_chunk,
      qk_backward_shared_bytes(p));
  stage(
      "chunk_wy_backward",
      "chunk_wy_backward",
      {outputs[kDv], backward[3], backward[4], backward[6], backward[9]},
      per_chunk,
      wy_backward_shared_bytes(p));
  if (p.per_key_gates) {
    stage(
        "channel_pairs_backward",
        "channel_pairs_backward",
        {backward[4], backward[6]},
        per_chunk,
        channel_pairs_shared_bytes(p));
  }
  return backward[6];
}

// recurrent_backward (recurrent_backward.cu); returns the partial sums'
// buffer, which qk_grad_reduce reads next.
mx::array recurrent_backward(
    const GatedDeltaParams& p,
    mx::cu::CommandEncoder& encoder,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    CoreArgs& a,
    BackwardArgs& o) {
  enum Output { kDq = 0, kDk, kDv, kDg, kDgamma, kDbeta, kDstate };
  const int columns = (p.key_dim + 31) / 32;
  const int row_blocks = backward_row_blocks(p.value_dim);
  // One block's rows of a state in scratch, the columns padded to whole
  // warps (kernel_args.h).
  const int64_t tile = int64_t(kBackwardRowsPerBlock) * columns * 32;
  const int64_t blocks = int64_t(p.batch) * p.value_heads * row_blocks;
  // boundaries, chunk_states, partials: BackwardArgs' order.
  std::vector<mx::array> buffers = {
      scratch(encoder, blocks * p.num_chunks() * tile),
      scratch(encoder, blocks * kChunk * tile),
      scratch(
          encoder,
          int64_t(p.batch) * p.tokens * p.value_heads * row_blocks *
              backward_partial_width(p.key_dim, p.per_key_gates))};
  o.boundaries = mx::gpu_ptr<float>(buffers[0]);
  o.chunk_states = mx::gpu_ptr<float>(buffers[1]);
  o.partials = mx::gpu_ptr<float>(buffers[2]);
  o.partial_blocks = row_blocks;
  void* params[] = {&a, &o};
  const std::string dtype = dtype_suffix(inputs[kV].dtype());
  std::vector<mx::array> writes = {outputs[kDv], outputs[kDstate]};
  writes.insert(writes.end(), buffers.begin(), buffers.end());
  set_arrays(encoder, inputs, writes);
  launch(
      encoder,
      "recurrent_backward",
      "gd_recurrent_backward_" + dtype + "_c" + std::to_string(columns) +
          (p.per_key_gates ? "_per_key" : ""),
      dim3(row_blocks, p.value_heads, p.batch),
      kBackwardThreads,
      int(sizeof(float)) * backward_shared_floats(p.key_dim, p.per_key_gates),
      params);
  return buffers[2];
}

}  // namespace

void eval_backward(
    const GatedDeltaParams& p,
    Algorithm algorithm,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    const mx::Stream& stream) {
  auto& encoder = mx::cu::get_command_encoder(stream);
  for (auto& output : outputs) {
    output.set_data(mx::allocator::malloc(output.nbytes()));
  }
  // With no value columns (Dv = 0) dq and dk still have elements: zeros,
  // which the kernels write.
  if (p.batch == 0 || p.value_heads == 0) {
    return;  // empty outputs: nothing to launch
  }
  enum Output { kDq = 0, kDk, kDv, kDg, kDgamma, kDbeta, kDstate };
  const int cotangents = p.has_mask ? kMask + 1 : kMask;
  CoreArgs a = input_args(p, inputs);
  BackwardArgs o{};
  o.dy = mx::gpu_ptr<void>(inputs[cotangents]);
  o.state_cotangent = mx::gpu_ptr<float>(inputs[cotangents + 1]);
  o.dq = mx::gpu_ptr<void>(outputs[kDq]);
  o.dk = mx::gpu_ptr<void>(outputs[kDk]);
  o.dv = mx::gpu_ptr<void>(outputs[kDv]);
  o.dg = mx::gpu_ptr<float>(outputs[kDg]);
  o.dgamma = mx::gpu_ptr<float>(outputs[kDgamma]);
  o.dbeta = mx::gpu_ptr<float>(outputs[kDbeta]);
  o.dstate = mx::gpu_ptr<float>(outputs[kDstate]);
  void* params[] = {&a, &o};
  const std::string dtype = dtype_suffix(inputs[kV].dtype());
  const mx::array partials =
      resolve_cuda_backward_algorithm(p, algorithm) == Algorithm::Chunked
      ? eval_chunked_backward(p, encoder, inputs, outputs, a, o)
      : recurrent_backward(p, encoder, inputs, outputs, a, o);
  const int64_t rows = int64_t(p.batch) * p.tokens * p.key_heads;
  if (rows == 0) {
    return;
  }
  std::vector<mx::array> reads = inputs;
  reads.push_back(partials);
  set_arrays(
      encoder,
      reads,
      {outputs[kDq],
       outputs[kDk],
       outputs[kDg],
       outputs[kDgamma],
       outputs[kDbeta]});
  launch(
      encoder,
      "recurrent_backward",
      "gd_qk_grad_reduce_" + dtype,
      dim3(unsigned((rows + kReduceWarps - 1) / kReduceWarps)),
      32 * kReduceWarps,
      0,
      params);
}

}  // namespace mlx_gated_delta::cuda
