#include "executor.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "guarded_buffer.h"
#include "launch.h"

namespace mlx_gated_delta::metal::emulator {

BufferOutputs run_plan(const Plan& plan, const BufferInputs& inputs,
                       std::chrono::milliseconds barrier_timeout) {
  validate_plan(plan);
  std::map<PlanBuffer, metal_emulator::GuardedBuffer> buffers;
  size_t inputs_used = 0;
  for (const BufferSpec& spec : plan.buffers) {
    metal_emulator::GuardedBuffer& buffer =
        buffers.try_emplace(spec.buffer, to_string(spec.buffer), spec.bytes).first->second;
    if (spec.role != BufferRole::Input) continue;
    auto source = inputs.find(spec.buffer);
    if (source == inputs.end() || source->second.size() != spec.bytes) {
      throw std::invalid_argument(
          std::string("metal emulator: input ") + to_string(spec.buffer) + " has " +
          (source == inputs.end() ? std::string("no data") : std::to_string(source->second.size()) + " bytes") +
          ", the plan expects " + std::to_string(spec.bytes));
    }
    if (spec.bytes > 0) std::memcpy(buffer.data(), source->second.data(), spec.bytes);
    ++inputs_used;
  }
  if (inputs_used != inputs.size()) {
    throw std::invalid_argument("metal emulator: an input was passed that the plan does not read");
  }
  // The kernels take their scalars by constant reference: one copy each.
  GatedDeltaKernelParams core_params = plan.kernel_params;
  SegmentKernelParams segment_params = plan.segment_params;
  for (const Dispatch& dispatch : plan.dispatches) {
    metal_emulator::Launch launch;
    launch.kernel = dispatch.kernel;
    for (const auto& [index, id, written] : dispatch.buffers) {
      launch.buffers[index] = buffers.at(id).data();
    }
    launch.buffers[dispatch.params_index] =
        dispatch.params_block == KernelParamsBlock::Core ? static_cast<void*>(&core_params)
                                                         : static_cast<void*>(&segment_params);
    launch.threadgroups = {dispatch.threadgroups.x, dispatch.threadgroups.y,
                           dispatch.threadgroups.z};
    launch.threads_per_threadgroup = {dispatch.threads_per_threadgroup.x,
                                      dispatch.threads_per_threadgroup.y,
                                      dispatch.threads_per_threadgroup.z};
    launch.threadgroup_memory_bytes = dispatch.threadgroup_memory_bytes;
    metal_emulator::run_launch(launch, barrier_timeout);
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
          std::memcmp(buffer.data(), inputs.at(spec.buffer).data(), spec.bytes) != 0) {
        throw std::runtime_error(std::string("metal emulator: the plan wrote its input ") +
                                 to_string(spec.buffer));
      }
    } else if (spec.role == BufferRole::Output) {
      outputs[spec.buffer].assign(buffer.data(), buffer.data() + buffer.size());
    }
  }
  return outputs;
}

}  // namespace mlx_gated_delta::metal::emulator
