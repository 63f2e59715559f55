// The CUDA executor: kernels recorded into the CUDA graph of MLX's command
// encoder for the stream, buffers from MLX's allocator, no host
// synchronisation (docs/cuda.md). The forward and the fused segment here, the
// backward in executor_backward.cpp, what they share in launch.cpp.
#include "cuda/executor.h"

#include <algorithm>
#include <optional>
#include <string>

#include "cuda/kernel_args.h"
#include "cuda/launch.h"
#include "cuda/launch_shapes.h"
#include "cuda/module.h"
#include "mlx/allocator.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"
#include "segment/segment_primitive.h"

namespace mx = mlx::core;

namespace mlx_gated_delta::cuda {

namespace {

// Shared memory of chunk_output (its layout in chunk_output.cu).
int output_shared_bytes(const GatedDeltaParams& p) {
  const int kp = tile_stride(p.key_dim), lp = tile_stride(kChunk);
  const int rp = tile_stride(kOutputRows);
  return int(sizeof(float)) *
      (kChunk * std::max(kp, rp) + kChunk * lp + kOutputRows * kp +
       kChunk * rp + kChunk);
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
  // The recurrent kernel, writing `writes` (y, the state and the
  // checkpoints a.y, a.state_out and a.checkpoint_states point into).
  const auto recurrent = [&](CoreArgs& args, std::vector<mx::array> writes) {
    const int columns = (p.key_dim + 31) / 32;
    if (p.has_tree) {
      args.parents = mx::gpu_ptr<int>(
          inputs[checkpoints_input + (p.checkpoint_count > 0 ? 1 : 0)]);
      writes.push_back(scratch(
          encoder,
          int64_t(p.batch) * p.value_heads * p.tokens * p.value_dim *
              p.key_dim));
      args.tree_states = mx::gpu_ptr<float>(writes.back());
    }
    void* params[] = {&args};
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
  };
  if (resolve_cuda_algorithm(p, algorithm) == Algorithm::Recurrent) {
    recurrent(a, outputs);
    return;
  }
  if (p.per_key_gates && p.checkpoint_count > 0) {
    // The chunked kernels keep no checkpoints with per-key gates (their
    // state update takes K decayed to the chunk's end only): the recurrent
    // kernel writes the checkpoint states, its y and state going to scratch,
    // and the chunked kernels y and the state, as for the call without
    // checkpoints.
    CoreArgs checkpointed = a;
    std::vector<mx::array> writes = {
        scratch(encoder, int64_t(outputs[0].size())),
        scratch(encoder, int64_t(outputs[1].size())),
        outputs[2]};
    checkpointed.y = mx::gpu_ptr<void>(writes[0]);
    checkpointed.state_out = mx::gpu_ptr<float>(writes[1]);
    recurrent(checkpointed, writes);
    a.checkpoints = nullptr;
    a.checkpoint_states = nullptr;
    a.checkpoint_count = 0;
  }
  ChunkForwardScratch s = chunk_forward_scratch(encoder, p, false);
  void* params[] = {&a, &s.pointers};
  const std::vector<mx::array> carry_outputs(
      outputs.begin() + 1, outputs.end());
  launch_prepare_and_carry(encoder, p, inputs, s, carry_outputs, params);
  // chunk_output reads everything chunk_carry read and wrote.
  std::vector<mx::array> reads = inputs;
  reads.insert(reads.end(), s.buffers.begin(), s.buffers.end());
  reads.insert(reads.end(), carry_outputs.begin(), carry_outputs.end());
  set_arrays(encoder, reads, {outputs[0]});
  launch(
      encoder,
      "chunk_output",
      "gd_chunk_output_" + dtype,
      dim3(
          p.num_chunks() * ((p.value_dim + kOutputRows - 1) / kOutputRows),
          p.value_heads,
          p.batch),
      kChunkedThreads,
      output_shared_bytes(p),
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
