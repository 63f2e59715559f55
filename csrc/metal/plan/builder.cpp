// The builder primitives (builder.h).
#include "metal/plan/builder.h"

#include <algorithm>
#include <stdexcept>

#include "validation/extents.h"

namespace mlx_gated_delta::metal {

std::string kernel_name(const char* stage, ActivationDtype dtype) {
  return std::string("gated_delta_") + stage + "_" + to_string(dtype);
}

PlanBuilder::PlanBuilder(
    const GatedDeltaParams& params, Algorithm algorithm, ActivationDtype dtype)
    : p(params), core_dtype(dtype) {
  plan.algorithm =
      algorithm == Algorithm::Auto ? resolve_metal_algorithm(p) : algorithm;
  plan.dtype = dtype;
  B = p.batch;
  T = p.tokens;
  Hk = p.key_heads;
  Hv = p.value_heads;
  Dk = p.key_dim;
  Dv = p.value_dim;
  C = p.num_chunks();
  padded_tokens = C * kChunkSize;
  e = element_bytes(dtype);
  GatedDeltaKernelParams& k = plan.kernel_params;
  set_kernel_shape(k, p);
  k.value_heads_per_key_head = p.value_heads / p.key_heads;
  k.head_mapping = p.head_mapping == HeadMapping::Grouped ? 0 : 1;
  k.normalize_qk = p.normalize_qk ? 1 : 0;
  k.has_mask = p.has_mask ? 1 : 0;
  k.num_chunks = unsigned(C);
  k.scale = p.scale;
  k.num_checkpoints = unsigned(p.checkpoint_count);
  k.has_tree = p.has_tree ? 1 : 0;
  if (p.has_tree && algorithm == Algorithm::Chunked) {
    throw std::invalid_argument(
        "tree verification (parents) runs the recurrent plan only");
  }
  k.per_key_gates = p.per_key_gates ? 1 : 0;

  using enum BufferRole;
  add_buffer(PlanBuffer::Query, B * T * Hk * Dk * e, Input);
  add_buffer(PlanBuffer::Key, B * T * Hk * Dk * e, Input);
  add_buffer(PlanBuffer::Value, B * T * Hv * Dv * e, Input);
  add_buffer(
      PlanBuffer::Gate, B * T * Hv * uint64_t(p.gate_width()) * 4, Input);
  add_buffer(PlanBuffer::Beta, B * T * Hv * 4, Input);
  if (p.has_mask)
    add_buffer(PlanBuffer::Mask, B * T, Input);
  add_buffer(PlanBuffer::StateIn, B * Hv * Dv * Dk * 4, Input);
  add_buffer(PlanBuffer::Output, B * T * Hv * Dv * e, Output);
  add_buffer(PlanBuffer::StateOut, B * Hv * Dv * Dk * 4, Output);
  if (p.checkpoint_count > 0) {
    const uint64_t N = p.checkpoint_count;
    check_launch_extent("checkpoint state elements", N * B * Hv * Dv * Dk);
    add_buffer(PlanBuffer::Checkpoints, N * 4, Input);
    add_buffer(PlanBuffer::CheckpointStates, N * B * Hv * Dv * Dk * 4, Output);
  }
  if (p.has_tree) {
    add_buffer(PlanBuffer::Parents, T * 4, Input);
    add_scratch(
        PlanBuffer::TreeStates, "tree state elements", B * Hv * T * Dv * Dk, 4);
  }
}

void PlanBuilder::add_scratch(
    PlanBuffer buffer,
    const char* what,
    uint64_t elements,
    uint64_t bytes_each) {
  check_launch_extent(what, elements);
  add_buffer(buffer, elements * bytes_each, BufferRole::Scratch);
}

Dispatch& PlanBuilder::add(
    const char* stage,
    std::string kernel,
    Grid3 groups,
    unsigned threads,
    size_t threadgroup_bytes,
    const std::vector<std::pair<unsigned, PlanBuffer>>& bindings,
    unsigned params_index,
    const std::vector<PlanBuffer>& writes) {
  Dispatch d;
  d.stage = stage;
  d.kernel = std::move(kernel);
  d.threadgroups = groups;
  d.threads_per_threadgroup = {threads, 1, 1};
  d.threadgroup_memory_bytes = threadgroup_bytes;
  for (auto [index, buffer] : bindings) {
    bool written =
        std::find(writes.begin(), writes.end(), buffer) != writes.end();
    if (plan.buffer_bytes(buffer) > 0)
      d.buffers.push_back({index, buffer, written});
  }
  d.params_index = params_index;
  plan.dispatches.push_back(std::move(d));
  return plan.dispatches.back();
}

Plan PlanBuilder::finish() {
  std::erase_if(plan.dispatches, [](const Dispatch& d) {
    return d.threadgroups.count() == 0;
  });
  validate_plan(plan);
  return std::move(plan);
}

}  // namespace mlx_gated_delta::metal
