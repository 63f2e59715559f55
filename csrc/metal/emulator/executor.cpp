#include "executor.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "dispatch.h"
#include "guarded_buffer.h"

namespace mlx_gated_delta::metal::emulator {

BufferOutputs run_plan(
    const Plan& plan,
    const BufferInputs& inputs,
    std::chrono::milliseconds barrier_timeout,
    const std::string& through_stage) {
  validate_plan(plan);
  size_t dispatch_count = plan.dispatches.size();
  if (!through_stage.empty()) {
    auto last = std::find_if(
        plan.dispatches.begin(), plan.dispatches.end(), [&](const Dispatch& d) {
          return d.stage == through_stage;
        });
    if (last == plan.dispatches.end()) {
      throw std::invalid_argument(
          "metal emulator: the plan has no stage " + through_stage);
    }
    dispatch_count = size_t(last - plan.dispatches.begin()) + 1;
  }
  std::map<PlanBuffer, metal_emulator::GuardedBuffer> buffers;
  size_t inputs_used = 0;
  for (const BufferSpec& spec : plan.buffers) {
    metal_emulator::GuardedBuffer& buffer =
        buffers.try_emplace(spec.buffer, to_string(spec.buffer), spec.bytes)
            .first->second;
    if (spec.role != BufferRole::Input)
      continue;
    auto source = inputs.find(spec.buffer);
    if (source == inputs.end() || source->second.size() != spec.bytes) {
      throw std::invalid_argument(
          std::string("metal emulator: input ") + to_string(spec.buffer) +
          " has " +
          (source == inputs.end()
               ? std::string("no data")
               : std::to_string(source->second.size()) + " bytes") +
          ", the plan expects " + std::to_string(spec.bytes));
    }
    if (spec.bytes > 0)
      std::memcpy(buffer.data(), source->second.data(), spec.bytes);
    ++inputs_used;
  }
  if (inputs_used != inputs.size()) {
    throw std::invalid_argument(
        "metal emulator: an input was passed that the plan does not read");
  }
  // The kernels take their scalars by constant reference: one copy each.
  GatedDeltaKernelParams core_params = plan.kernel_params;
  SegmentKernelParams segment_params = plan.segment_params;
  for (size_t n = 0; n < dispatch_count; ++n) {
    const Dispatch& dispatch = plan.dispatches[n];
    metal_emulator::Dispatch emulated;
    emulated.kernel = dispatch.kernel;
    for (const auto& [index, id, written] : dispatch.buffers) {
      emulated.buffers[index] = buffers.at(id).data();
    }
    // A per-chunk stage's chunk, bound like Metal's setBytes: a copy.
    uint32_t chunk = dispatch.chunk ? dispatch.chunk->chunk : 0;
    if (dispatch.chunk)
      emulated.buffers[dispatch.chunk->index] = &chunk;
    emulated.buffers[dispatch.params_index] =
        dispatch.params_block == KernelParamsBlock::Core
        ? static_cast<void*>(&core_params)
        : static_cast<void*>(&segment_params);
    emulated.threadgroups = {
        dispatch.threadgroups.x,
        dispatch.threadgroups.y,
        dispatch.threadgroups.z};
    emulated.threads_per_threadgroup = {
        dispatch.threads_per_threadgroup.x,
        dispatch.threads_per_threadgroup.y,
        dispatch.threads_per_threadgroup.z};
    emulated.threadgroup_memory_bytes = dispatch.threadgroup_memory_bytes;
    metal_emulator::run_dispatch(emulated, barrier_timeout);
    for (const auto& [id, buffer] : buffers) {
      buffer.check_guards(dispatch.stage + " (" + dispatch.kernel + ")");
    }
  }
  BufferOutputs outputs;
  for (const BufferSpec& spec : plan.buffers) {
    metal_emulator::GuardedBuffer& buffer = buffers.at(spec.buffer);
    if (spec.role == BufferRole::Input) {
      // A pure function: no dispatch may have written an input.
      if (spec.bytes > 0 &&
          std::memcmp(
              buffer.data(), inputs.at(spec.buffer).data(), spec.bytes) != 0) {
        throw std::runtime_error(
            std::string("metal emulator: the plan wrote its input ") +
            to_string(spec.buffer));
      }
    } else if (spec.role == BufferRole::Output || !through_stage.empty()) {
      outputs[spec.buffer].assign(buffer.data(), buffer.data() + buffer.size());
    }
  }
  return outputs;
}

}  // namespace mlx_gated_delta::metal::emulator
