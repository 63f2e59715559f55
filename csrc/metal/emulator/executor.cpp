#include "executor.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "guarded_buffer.h"
#include "launch.h"

namespace mlx_gated_delta::metal::emulator {

namespace {

std::span<const std::byte> input_for(PlanBuffer id, const CallInputs& inputs) {
  switch (id) {
    case PlanBuffer::Query: return inputs.q;
    case PlanBuffer::Key: return inputs.k;
    case PlanBuffer::Value: return inputs.v;
    case PlanBuffer::Gate: return inputs.g;
    case PlanBuffer::Beta: return inputs.beta;
    case PlanBuffer::Mask: return inputs.mask;
    case PlanBuffer::StateIn: return inputs.state;
    default: return {};
  }
}

bool is_input(PlanBuffer id) {
  return id <= PlanBuffer::StateIn;
}

}  // namespace

CallOutputs run_plan(const Plan& plan, const CallInputs& inputs,
                     std::chrono::milliseconds barrier_timeout) {
  validate_plan(plan);
  std::map<PlanBuffer, metal_emulator::GuardedBuffer> buffers;
  for (const BufferSpec& spec : plan.buffers) {
    metal_emulator::GuardedBuffer& buffer =
        buffers.try_emplace(spec.buffer, to_string(spec.buffer), spec.bytes).first->second;
    if (is_input(spec.buffer)) {
      std::span<const std::byte> source = input_for(spec.buffer, inputs);
      if (source.size() != spec.bytes) {
        throw std::invalid_argument(std::string("metal emulator: input ") + to_string(spec.buffer) +
                                    " has " + std::to_string(source.size()) +
                                    " bytes, the plan expects " + std::to_string(spec.bytes));
      }
      if (!source.empty()) std::memcpy(buffer.data(), source.data(), source.size());
    }
  }
  GatedDeltaKernelParams params = plan.kernel_params;
  for (const Dispatch& dispatch : plan.dispatches) {
    metal_emulator::Launch launch;
    launch.kernel = dispatch.kernel;
    for (const auto& [index, id, written] : dispatch.buffers) {
      launch.buffers[index] = buffers.at(id).data();
    }
    launch.buffers[dispatch.params_index] = &params;
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
  // A pure function: no dispatch may have written an input.
  for (auto& [id, buffer] : buffers) {
    if (!is_input(id) || buffer.size() == 0) continue;
    if (std::memcmp(buffer.data(), input_for(id, inputs).data(), buffer.size()) != 0) {
      throw std::runtime_error(std::string("metal emulator: the plan wrote its input ") +
                               to_string(id));
    }
  }
  CallOutputs outputs;
  metal_emulator::GuardedBuffer& y = buffers.at(PlanBuffer::Output);
  metal_emulator::GuardedBuffer& state = buffers.at(PlanBuffer::StateOut);
  outputs.y.assign(y.data(), y.data() + y.size());
  outputs.state.assign(state.data(), state.data() + state.size());
  return outputs;
}

}  // namespace mlx_gated_delta::metal::emulator
