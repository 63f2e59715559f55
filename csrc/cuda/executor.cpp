// The CUDA executor: kernels recorded into the CUDA graph of MLX's command
// encoder for the stream, buffers from MLX's allocator, no host
// synchronisation (docs/cuda.md).
#include "cuda/executor.h"

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>

#include "cuda/kernel_args.h"
#include "cuda/launch_shapes.h"
#include "cuda/module.h"
#include "mlx/allocator.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"
#include "segment/segment_primitive.h"

namespace mx = mlx::core;

namespace mlx_gated_delta::cuda {

namespace {

enum CoreInput { kQ = 0, kK, kV, kG, kBeta, kState, kMask };

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
  return !p.per_key_gates && !p.has_tree && p.key_dim <= kChunkedMaxDim &&
      p.value_dim <= kChunkedMaxDim;
}

// A float32 scratch buffer from MLX's allocator, kept alive until the
// encoder's graph has run.
// At least one float, so that an empty scratch (a call of no tokens) still
// has an address to pass.
mx::array scratch(mx::cu::CommandEncoder& encoder, int64_t floats) {
  floats = std::max<int64_t>(floats, 1);
  mx::array buffer(
      mx::allocator::malloc(size_t(floats) * sizeof(float)),
      {int(floats)},
      mx::float32);
  encoder.add_temporary(buffer);
  return buffer;
}

// The encoder orders graph nodes by the buffers they read and write: each
// kernel names its own, the scratch included, just before it is added.
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

// Shared memory of chunk_prepare, chunk_carry and chunk_output (their
// layouts in chunk_prepare.cu, chunk_carry.cu and chunk_output.cu).
int prepare_shared_bytes(const GatedDeltaParams& p) {
  const int kp = tile_stride(p.key_dim), vp = tile_stride(p.value_dim);
  const int lp = tile_stride(kChunk);
  const int sums = (kChunk / kTile - 1) * kTile * tile_stride(kTile);
  return int(sizeof(float)) *
      (kChunk * kp + kChunk * std::max(kp, vp) + 2 * kChunk * lp + sums +
       7 * kChunk);
}
// chunk_carry's blocks and shared memory (sized for Dk up to kChunkedMaxDim).
dim3 carry_grid(const GatedDeltaParams& p) {
  return dim3(
      (p.value_dim + kCarryBlockRows - 1) / kCarryBlockRows,
      p.value_heads,
      p.batch);
}
constexpr int kCarrySharedBytes = int(sizeof(float)) * kCarrySharedFloats;
int output_shared_bytes(const GatedDeltaParams& p) {
  const int kp = tile_stride(p.key_dim), lp = tile_stride(kChunk);
  const int rp = tile_stride(kOutputRows);
  return int(sizeof(float)) *
      (kChunk * std::max(kp, rp) + kChunk * lp + kOutputRows * kp +
       kChunk * rp + kChunk);
}

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
       kDecayRows * kChunk);
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

// The inputs and dims that the forward and the backward read alike.
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

}  // namespace

std::string core_kernels_gap(const GatedDeltaParams& p) {
  if (p.key_dim <= kRecurrentMaxKeyDim) {
    return "";
  }
  return "key dim " + std::to_string(p.key_dim) +
      " (the kernels take key dims up to " +
      std::to_string(kRecurrentMaxKeyDim) + ")";
}

Algorithm resolve_cuda_algorithm(
    const GatedDeltaParams& p, Algorithm requested) {
  if (!chunked_kernels_cover(p)) {
    return Algorithm::Recurrent;
  }
  if (requested == Algorithm::Auto) {
    return p.tokens >= kChunk ? Algorithm::Chunked : Algorithm::Recurrent;
  }
  return requested;
}

void eval_core(
    const GatedDeltaParams& p,
    Algorithm algorithm,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    const mx::Stream& stream) {
  auto& encoder = mx::cu::get_command_encoder(stream);
  for (auto& output : outputs) {
    output.set_data(mx::allocator::malloc(output.nbytes()));
  }
  if (p.batch == 0 || p.value_heads == 0 || p.value_dim == 0) {
    return;  // empty outputs: nothing to launch
  }

  CoreArgs a = input_args(p, inputs);
  a.y = mx::gpu_ptr<void>(outputs[0]);
  a.state_out = mx::gpu_ptr<float>(outputs[1]);
  const int checkpoints_input = p.has_mask ? kMask + 1 : kMask;
  if (p.checkpoint_count > 0) {
    a.checkpoints = mx::gpu_ptr<int>(inputs[checkpoints_input]);
    a.checkpoint_states = mx::gpu_ptr<float>(outputs[2]);
  }

  const std::string dtype = dtype_suffix(inputs[kV].dtype());
  if (resolve_cuda_algorithm(p, algorithm) == Algorithm::Recurrent) {
    const int columns = (p.key_dim + 31) / 32;
    std::vector<mx::array> writes = outputs;
    if (p.has_tree) {
      a.parents = mx::gpu_ptr<int>(
          inputs[checkpoints_input + (p.checkpoint_count > 0 ? 1 : 0)]);
      writes.push_back(scratch(
          encoder,
          int64_t(p.batch) * p.value_heads * p.tokens * p.value_dim *
              p.key_dim));
      a.tree_states = mx::gpu_ptr<float>(writes.back());
    }
    void* params[] = {&a};
    set_arrays(encoder, inputs, writes);
    launch(
        encoder,
        "recurrent",
        "gd_recurrent_" + dtype + "_c" + std::to_string(columns),
        dim3(
            (p.value_dim + recurrent_rows_per_block(columns) - 1) /
                recurrent_rows_per_block(columns),
            p.value_heads,
            p.batch),
        kRecurrentThreads,
        0,
        params);
    return;
  }
  const int chunks = p.num_chunks();
  const int64_t problems = int64_t(p.batch) * p.value_heads * chunks;
  const int64_t key_problems = int64_t(p.batch) * p.key_heads * chunks;
  // w, u (then v'), qk, decays, h, k: ChunkScratch's order.
  std::vector<mx::array> buffers = {
      scratch(encoder, problems * kChunk * tile_padded(p.key_dim)),
      scratch(encoder, problems * kChunk * tile_padded(p.value_dim)),
      scratch(encoder, problems * kChunk * kChunk),
      scratch(encoder, problems * kDecayRows * kChunk),
      scratch(encoder, problems * p.value_dim * p.key_dim),
      scratch(encoder, key_problems * kChunk * tile_padded(p.key_dim))};
  ChunkScratch s{};
  s.w = mx::gpu_ptr<float>(buffers[0]);
  s.u = mx::gpu_ptr<float>(buffers[1]);
  s.qk = mx::gpu_ptr<float>(buffers[2]);
  s.decays = mx::gpu_ptr<float>(buffers[3]);
  s.h = mx::gpu_ptr<float>(buffers[4]);
  s.k = mx::gpu_ptr<float>(buffers[5]);
  void* params[] = {&a, &s};
  // chunk_prepare writes everything but h.
  std::vector<mx::array> prepared(buffers.begin(), buffers.begin() + 4);
  prepared.push_back(buffers[5]);
  set_arrays(encoder, inputs, prepared);
  launch(
      encoder,
      "chunk_prepare",
      "gd_chunk_prepare_" + dtype,
      dim3(chunks, p.value_heads, p.batch),
      kChunkedThreads,
      prepare_shared_bytes(p),
      params);
  // chunk_carry reads the prepared scratch and writes v' (over u), h, the
  // final state and the checkpoints; chunk_output reads all of them.
  std::vector<mx::array> reads = inputs;
  reads.insert(reads.end(), buffers.begin(), buffers.end());
  std::vector<mx::array> writes = {buffers[1], buffers[4]};
  writes.insert(writes.end(), outputs.begin() + 1, outputs.end());
  set_arrays(encoder, reads, writes);
  launch(
      encoder,
      "chunk_carry",
      "gd_chunk_carry_" + dtype,
      carry_grid(p),
      kChunkedThreads,
      kCarrySharedBytes,
      params);
  reads.insert(reads.end(), outputs.begin() + 1, outputs.end());
  set_arrays(encoder, reads, {outputs[0]});
  launch(
      encoder,
      "chunk_output",
      "gd_chunk_output_" + dtype,
      dim3(
          chunks * ((p.value_dim + kOutputRows - 1) / kOutputRows),
          p.value_heads,
          p.batch),
      kChunkedThreads,
      output_shared_bytes(p),
      params);
}

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

Algorithm resolve_cuda_backward_algorithm(
    const GatedDeltaParams& p, Algorithm requested) {
  if (!chunked_kernels_cover(p) || p.key_dim == 0 || p.value_dim == 0) {
    return Algorithm::Recurrent;
  }
  if (requested == Algorithm::Auto) {
    return p.tokens >= kChunk ? Algorithm::Chunked : Algorithm::Recurrent;
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
  const int64_t key_problems = int64_t(p.batch) * p.key_heads * chunks;
  const int64_t key_rows = problems * kChunk * tile_padded(p.key_dim);
  const int64_t value_rows = problems * kChunk * tile_padded(p.value_dim);
  const int64_t states = problems * p.value_dim * p.key_dim;
  // The forward's: w, u (then v'), qk, decays, h, k, t (ChunkScratch's
  // order), and its final state, which nothing reads.
  std::vector<mx::array> forward = {
      scratch(encoder, key_rows),
      scratch(encoder, value_rows),
      scratch(encoder, problems * kChunk * kChunk),
      scratch(encoder, problems * kDecayRows * kChunk),
      scratch(encoder, states),
      scratch(encoder, key_problems * kChunk * tile_padded(p.key_dim)),
      scratch(encoder, problems * kChunk * kChunk),
      scratch(
          encoder, int64_t(p.batch) * p.value_heads * p.value_dim * p.key_dim)};
  ChunkScratch s{};
  s.w = mx::gpu_ptr<float>(forward[0]);
  s.u = mx::gpu_ptr<float>(forward[1]);
  s.qk = mx::gpu_ptr<float>(forward[2]);
  s.decays = mx::gpu_ptr<float>(forward[3]);
  s.h = mx::gpu_ptr<float>(forward[4]);
  s.k = mx::gpu_ptr<float>(forward[5]);
  s.t = mx::gpu_ptr<float>(forward[6]);
  a.state_out = mx::gpu_ptr<float>(forward[7]);
  // dv, ds, dq, dk, dw, state_dots (ChunkBackwardScratch's order), each
  // token's sums of a value head (BackwardArgs::partials, one block), then
  // ChunkBackwardScratch's pairs and ends.
  std::vector<mx::array> backward = {
      scratch(encoder, value_rows),
      scratch(
          encoder,
          problems * tile_padded(p.value_dim) * tile_padded(p.key_dim)),
      scratch(encoder, key_rows),
      scratch(encoder, key_rows),
      scratch(encoder, key_rows),
      scratch(encoder, problems * kStateSlices),
      scratch(
          encoder,
          int64_t(p.batch) * p.tokens * p.value_heads *
              backward_partial_width(p.key_dim, false)),
      scratch(encoder, problems * kChunk * kChunk),
      scratch(encoder, problems * 2 * kChunk)};
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
  o.partial_blocks = 1;

  const std::string dtype = dtype_suffix(inputs[kV].dtype());
  const int row_tiles = (p.value_dim + kCarryRows - 1) / kCarryRows;
  void* forward_params[] = {&a, &s};
  std::vector<mx::array> prepared(forward.begin(), forward.begin() + 4);
  prepared.insert(prepared.end(), forward.begin() + 5, forward.begin() + 7);
  set_arrays(encoder, inputs, prepared);
  launch(
      encoder,
      "chunk_prepare",
      "gd_chunk_prepare_" + dtype,
      dim3(chunks, p.value_heads, p.batch),
      kChunkedThreads,
      prepare_shared_bytes(p),
      forward_params);
  std::vector<mx::array> reads = inputs;
  reads.insert(reads.end(), forward.begin(), forward.end());
  set_arrays(encoder, reads, {forward[1], forward[4], forward[7]});
  launch(
      encoder,
      "chunk_carry",
      "gd_chunk_carry_" + dtype,
      carry_grid(p),
      kChunkedThreads,
      kCarrySharedBytes,
      forward_params);

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
      {outputs[kDv], backward[3], backward[6]},
      per_chunk,
      wy_backward_shared_bytes(p));
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

namespace {

// Moves a buffer of MLX's allocator (unified memory) to the GPU, ordered on
// the stream before the kernels that use it (module.h).
void prefetch(mx::cu::CommandEncoder& encoder, const mx::array& a) {
  if (a.nbytes() > 0) {
    encoder.device().make_current();
    prefetch_to_device(
        encoder.device().cuda_device(),
        mx::gpu_ptr<void>(a),
        a.nbytes(),
        encoder.stream());
  }
}

// The data of a segment buffer, or nullptr for an empty one (a conv state
// of a one-tap conv, say), which may have no allocation to point into.
template <typename T>
T* data_or_null(const mx::array& a) {
  return a.nbytes() > 0 ? static_cast<T*>(mx::gpu_ptr<void>(a)) : nullptr;
}

}  // namespace

void eval_segment(
    const SegmentParams& p,
    Algorithm algorithm,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    const mx::Stream& stream) {
  auto& encoder = mx::cu::get_command_encoder(stream);
  const mx::array& mixed = inputs[SegmentInput::kMixedQkvzba];
  const mx::array& conv_weight = inputs[SegmentInput::kConvWeight];
  const mx::array& decay_parameter = inputs[SegmentInput::kDecayParameter];
  const mx::array& dt_bias = inputs[SegmentInput::kDtBias];
  const mx::array& norm_weight = inputs[SegmentInput::kNormWeight];
  const mx::array& conv_state = inputs[SegmentInput::kConvState];
  const std::optional<mx::array> mask =
      p.has_mask ? std::optional(inputs[SegmentInput::kMask]) : std::nullopt;
  const std::optional<mx::array> checkpoints = p.checkpoint_count > 0
      ? std::optional(inputs[SegmentInput::kMask + (p.has_mask ? 1 : 0)])
      : std::nullopt;
  enum Output {
    kOut = 0,
    kConvStateOut,
    kStateOut,
    kConvCheckpointStates,
    kCheckpointStates
  };
  // eval_core allocates the state and the state checkpoints, its outputs.
  for (int i : {kOut, kConvStateOut, kConvCheckpointStates}) {
    if (i < int(outputs.size())) {
      outputs[i].set_data(mx::allocator::malloc(outputs[i].nbytes()));
    }
  }
  const int64_t rows = int64_t(p.batch) * p.tokens;
  // q, k, v, g, beta: the float32 inputs of the core, views of one scratch
  // buffer. One allocation a call, not five: MLX's exported allocator hands
  // out unified memory, and a cached device buffer it reuses for that is
  // first copied into new unified memory (docs/cuda.md).
  const int64_t parts[] = {
      rows * p.qk_width(),
      rows * p.qk_width(),
      rows * p.v_width(),
      rows * p.gate_width(),
      rows * p.value_heads};
  int64_t total = 0;
  for (int64_t size : parts) {
    total += size;
  }
  const mx::array stages = scratch(encoder, total);
  prefetch(encoder, stages);
  for (int i : {kOut, kConvStateOut, kConvCheckpointStates}) {
    if (i < int(outputs.size())) {
      prefetch(encoder, outputs[i]);
    }
  }
  std::vector<mx::array> core_inputs;
  int64_t offset = 0;
  for (int64_t size : parts) {
    mx::array view({int(std::max<int64_t>(size, 1))}, mx::float32, nullptr, {});
    view.copy_shared_buffer(stages, {1}, stages.flags(), size, offset);
    core_inputs.push_back(view);
    offset += size;
  }
  core_inputs.push_back(inputs[SegmentInput::kState]);

  SegmentArgs a{};
  a.mixed = data_or_null<void>(mixed);
  a.conv_weight = data_or_null<float>(conv_weight);
  a.decay_parameter = data_or_null<float>(decay_parameter);
  a.dt_bias = data_or_null<float>(dt_bias);
  a.norm_weight = data_or_null<float>(norm_weight);
  a.conv_state_in = data_or_null<void>(conv_state);
  a.mask = mask ? data_or_null<bool>(*mask) : nullptr;
  a.checkpoints = checkpoints ? data_or_null<int>(*checkpoints) : nullptr;
  a.out = data_or_null<void>(outputs[kOut]);
  a.conv_state_out = data_or_null<void>(outputs[kConvStateOut]);
  a.conv_checkpoint_states = checkpoints
      ? data_or_null<void>(outputs[kConvCheckpointStates])
      : nullptr;
  a.q = data_or_null<float>(core_inputs[0]);
  a.k = data_or_null<float>(core_inputs[1]);
  a.v = data_or_null<float>(core_inputs[2]);
  a.g = data_or_null<float>(core_inputs[3]);
  a.beta = data_or_null<float>(core_inputs[4]);
  a.batch = p.batch;
  a.tokens = p.tokens;
  a.key_heads = p.key_heads;
  a.value_heads = p.value_heads;
  a.key_dim = p.key_dim;
  a.value_dim = p.value_dim;
  a.conv_kernel = p.conv_kernel;
  a.conv_channels = p.conv_channels();
  a.mixed_width = p.mixed_qkvzba_width();
  a.z_offset = p.z_offset();
  a.b_offset = p.b_offset();
  a.a_offset = p.a_offset();
  a.gate_width = p.value_heads > 0 ? p.gate_width() / p.value_heads : 1;
  a.log_rate =
      p.decay_parameterization == DecayParameterization::LogRate ? 1 : 0;
  a.has_lower_bound = p.gates.has_lower_bound ? 1 : 0;
  a.lower_bound = p.gates.lower_bound;
  a.beta_scale = p.gates.allow_neg_eigval ? 2.0f : 1.0f;
  a.sigmoid_output_gate = p.gates.output_gate == OutputGate::Sigmoid ? 1 : 0;
  a.norm_eps = p.norm_eps;
  a.checkpoint_count = p.checkpoint_count;
  void* params[] = {&a};
  const std::string dtype = dtype_suffix(mixed.dtype());
  const int64_t channel_blocks =
      (p.conv_channels() + kSegmentThreads - 1) / kSegmentThreads;
  auto launch_stage = [&](const char* stage, int64_t blocks, int threads) {
    if (blocks > 0) {
      launch(
          encoder,
          "segment",
          std::string("gd_segment_") + stage + "_" + dtype,
          dim3(unsigned(blocks)),
          threads,
          0,
          params);
    }
  };

  std::vector<mx::array> conv_reads = {mixed, conv_weight, conv_state};
  if (mask) {
    conv_reads.push_back(*mask);
  }
  set_arrays(encoder, conv_reads, {stages});
  launch_stage("prepare_conv", rows * channel_blocks, kSegmentThreads);
  set_arrays(encoder, {mixed, decay_parameter, dt_bias}, {stages});
  launch_stage(
      "prepare_gates",
      (rows * p.gate_width() + kSegmentThreads - 1) / kSegmentThreads,
      kSegmentThreads);
  std::vector<mx::array> collected = {outputs[kConvStateOut]};
  if (checkpoints) {
    conv_reads.push_back(*checkpoints);
    collected.push_back(outputs[kConvCheckpointStates]);
  }
  set_arrays(encoder, conv_reads, collected);
  launch_stage(
      "collect_conv_state",
      channel_blocks * p.conv_state_rows() * (1 + p.checkpoint_count) * p.batch,
      kSegmentThreads);

  // The core, on the float32 buffers; its y, float32, feeds gated_norm.
  if (mask) {
    core_inputs.push_back(*mask);
  }
  if (checkpoints) {
    core_inputs.push_back(*checkpoints);
  }
  mx::array y(
      {p.batch, p.tokens, p.value_heads, p.value_dim},
      mx::float32,
      nullptr,
      {});
  // With checkpoints (even none) the state checkpoints are eval_core's too.
  std::vector<mx::array> core_outputs = {y, outputs[kStateOut]};
  if (int(outputs.size()) > kCheckpointStates) {
    core_outputs.push_back(outputs[kCheckpointStates]);
  }
  eval_core(p.core_params(), algorithm, core_inputs, core_outputs, stream);
  encoder.add_temporary(y);
  // Enqueued now, they still precede the graph of these kernels on the
  // stream: the encoder launches it when it commits.
  for (const mx::array& output : core_outputs) {
    prefetch(encoder, output);
  }

  a.y = data_or_null<float>(y);
  std::vector<mx::array> norm_reads = {y, mixed, norm_weight};
  if (mask) {
    norm_reads.push_back(*mask);
  }
  set_arrays(encoder, norm_reads, {outputs[kOut]});
  launch_stage(
      "gated_norm",
      (rows * p.value_heads + kGatedNormWarps - 1) / kGatedNormWarps,
      32 * kGatedNormWarps);
}

}  // namespace mlx_gated_delta::cuda
