// The fused layer segment's plan (plan.h, make_segment_plan): its own stages
// around the core's (builder.h).
#include <algorithm>
#include <string>

#include "metal/plan/builder.h"
#include "validation/extents.h"

namespace mlx_gated_delta::metal {

namespace {

// The segment's stages around the core's: q, k, v, g, beta and y become
// float32 scratch between them, and the segment's own buffers are added.
struct SegmentPlanBuilder : PlanBuilder {
  const SegmentParams& sp;
  uint64_t channels, mixed_qkvzba_width, taps, conv_rows, segment_e;
  unsigned channel_threads, channel_groups;

  SegmentPlanBuilder(
      const SegmentParams& params,
      const GatedDeltaParams& core_params,
      Algorithm algorithm,
      ActivationDtype dtype)
      : PlanBuilder(core_params, algorithm, ActivationDtype::Float32),
        sp(params) {
    using enum PlanBuffer;
    plan.dtype = dtype;
    channels = sp.conv_channels();
    mixed_qkvzba_width = sp.mixed_qkvzba_width();
    taps = sp.conv_kernel;
    conv_rows = sp.conv_state_rows();
    segment_e = element_bytes(dtype);
    // One thread per channel: a threadgroup spans up to kSegmentThreads
    // channels.
    channel_threads = unsigned(
        std::min<uint64_t>(kSegmentThreads, (channels + 31) / 32 * 32));
    channel_groups = ceil_div(channels, channel_threads);

    chunked_scratch();
    for (BufferSpec& spec : plan.buffers) {
      if (spec.buffer == Query || spec.buffer == Key || spec.buffer == Value ||
          spec.buffer == Gate || spec.buffer == Beta || spec.buffer == Output) {
        spec.role = BufferRole::Scratch;
      }
    }
    const uint64_t Fe = B * T * mixed_qkvzba_width * segment_e,
                   state_bytes = B * conv_rows * channels * segment_e;
    add_buffer(MixedQkvzba, Fe, BufferRole::Input);
    add_buffer(ConvWeight, channels * taps * 4, BufferRole::Input);
    add_buffer(DecayParameter, Hv * 4, BufferRole::Input);
    add_buffer(DtBias, uint64_t(sp.gate_width()) * 4, BufferRole::Input);
    add_buffer(NormWeight, Dv * 4, BufferRole::Input);
    add_buffer(ConvStateIn, state_bytes, BufferRole::Input);
    add_buffer(SegmentOutput, B * T * Hv * Dv * segment_e, BufferRole::Output);
    add_buffer(ConvStateOut, state_bytes, BufferRole::Output);
    if (sp.checkpoint_count > 0) {
      check_launch_extent(
          "conv checkpoint state elements",
          sp.checkpoint_count * B * conv_rows * channels);
      add_buffer(
          ConvCheckpointStates,
          sp.checkpoint_count * state_bytes,
          BufferRole::Output);
    }

    SegmentKernelParams& k = plan.segment_params;
    set_kernel_shape(k, sp);
    k.conv_kernel = sp.conv_kernel;
    k.conv_channels = unsigned(channels);
    k.mixed_qkvzba_width = unsigned(mixed_qkvzba_width);
    k.z_offset = sp.z_offset();
    k.b_offset = sp.b_offset();
    k.a_offset = sp.a_offset();
    k.log_rate =
        sp.decay_parameterization == DecayParameterization::LogRate ? 1 : 0;
    k.has_mask = sp.has_mask ? 1 : 0;
    k.norm_eps = sp.norm_eps;
    k.gate_width = unsigned(sp.gate_width() / sp.value_heads);
    k.has_lower_bound = sp.gates.has_lower_bound ? 1 : 0;
    k.lower_bound = sp.gates.lower_bound;
    k.beta_scale = sp.gates.allow_neg_eigval ? 2.0f : 1.0f;
    k.sigmoid_output_gate = sp.gates.output_gate == OutputGate::Sigmoid ? 1 : 0;
  }

  Dispatch& add_segment(
      const char* stage,
      Grid3 groups,
      unsigned threads,
      const std::vector<std::pair<unsigned, PlanBuffer>>& bindings,
      unsigned params_index,
      const std::vector<PlanBuffer>& writes) {
    Dispatch& d =
        add(stage,
            kernel_name((std::string("segment_") + stage).c_str(), plan.dtype),
            groups,
            threads,
            0,
            bindings,
            params_index,
            writes);
    d.params_block = KernelParamsBlock::Segment;
    return d;
  }

  void prepare_conv() {
    using enum PlanBuffer;
    Dispatch& d = add_segment(
        "prepare_conv",
        {channel_groups, unsigned(T), unsigned(B)},
        channel_threads,
        {{0, MixedQkvzba},
         {1, ConvWeight},
         {2, ConvStateIn},
         {3, Mask},
         {4, Query},
         {5, Key},
         {6, Value}},
        7,
        {Query, Key, Value});
    // Each input read once (the windows' repeats come from caches), q|k|v
    // written float32; K multiply-adds and a SiLU per output.
    d.bytes_moved =
        double(B * T * channels * (segment_e + 4) + channels * taps * 4);
    d.flops = double(B * T * channels * (2 * taps + 4));
  }

  void prepare_gates() {
    using enum PlanBuffer;
    Dispatch& d = add_segment(
        "prepare_gates",
        {ceil_div(B * T * Hv, kSegmentThreads), 1, 1},
        kSegmentThreads,
        {{0, MixedQkvzba},
         {1, DecayParameter},
         {2, DtBias},
         {3, Gate},
         {4, Beta}},
        5,
        {Gate, Beta});
    // Per (token, value head): b and gate_width a values read, as many g
    // and one beta written.
    const uint64_t width = sp.gate_width() / sp.value_heads;
    d.bytes_moved = double(B * T * Hv * ((1 + width) * (segment_e + 4)));
    d.flops = double(B * T * Hv * (6 + 6 * width));
  }

  void collect_conv_state() {
    using enum PlanBuffer;
    Dispatch& d = add_segment(
        "collect_conv_state",
        {channel_groups, unsigned(conv_rows), unsigned(B)},
        channel_threads,
        {{0, MixedQkvzba}, {1, ConvStateIn}, {2, Mask}, {3, ConvStateOut}},
        4,
        {ConvStateOut});
    d.bytes_moved = double(2 * B * conv_rows * channels * segment_e);
  }

  // Only with checkpoints: collect_conv_state for the call cut after each one.
  void collect_conv_checkpoints() {
    using enum PlanBuffer;
    if (sp.checkpoint_count == 0)
      return;
    Dispatch& d = add_segment(
        "collect_conv_checkpoints",
        {channel_groups,
         unsigned(conv_rows),
         unsigned(sp.checkpoint_count * B)},
        channel_threads,
        {{0, MixedQkvzba},
         {1, ConvStateIn},
         {2, Mask},
         {3, Checkpoints},
         {4, ConvCheckpointStates}},
        5,
        {ConvCheckpointStates});
    d.bytes_moved =
        double(2 * sp.checkpoint_count * B * conv_rows * channels * segment_e);
  }

  void gated_norm() {
    using enum PlanBuffer;
    Dispatch& d = add_segment(
        "gated_norm",
        {ceil_div(B * T * Hv, kGatedNormRowsPerThreadgroup), 1, 1},
        kGatedNormRowsPerThreadgroup * 32,
        {{0, Output},
         {1, MixedQkvzba},
         {2, NormWeight},
         {3, Mask},
         {4, SegmentOutput}},
        5,
        {SegmentOutput});
    d.bytes_moved = double(B * T * Hv * Dv * (4 + 2 * segment_e));
    d.flops = double(B * T * Hv * Dv * 10);
  }
};

}  // namespace

Plan make_segment_plan(
    const SegmentParams& sp, Algorithm algorithm, ActivationDtype dtype) {
  validate_segment_plan_shape(sp);
  // The core reads float32 q, k, v, g and beta that the segment's stages
  // write, and its float32 y feeds gated_norm.
  const GatedDeltaParams core = sp.core_params();
  validate_plan_shape(core);
  SegmentPlanBuilder builder(sp, core, algorithm, dtype);
  builder.prepare_conv();
  builder.prepare_gates();
  builder.collect_conv_state();
  builder.collect_conv_checkpoints();
  builder.core();
  builder.gated_norm();
  return builder.finish();
}

}  // namespace mlx_gated_delta::metal
