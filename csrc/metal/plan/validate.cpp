// Every plan held to Metal's limits (plan.h, validate_plan).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "metal/plan/plan.h"

namespace mlx_gated_delta::metal {

void validate_plan(const Plan& plan) {
  for (const Dispatch& d : plan.dispatches) {
    uint64_t threads = d.threads_per_threadgroup.count();
    if (threads == 0 || threads > kMaxThreadsPerThreadgroup) {
      throw std::invalid_argument(
          d.kernel + ": " + std::to_string(threads) +
          " threads per threadgroup (Metal allows 1 to " +
          std::to_string(kMaxThreadsPerThreadgroup) + ")");
    }
    if (d.threadgroup_memory_bytes > kMaxThreadgroupMemoryBytes) {
      throw std::invalid_argument(
          d.kernel + ": " + std::to_string(d.threadgroup_memory_bytes) +
          " bytes of threadgroup memory (Metal allows " +
          std::to_string(kMaxThreadgroupMemoryBytes) + ")");
    }
    for (const auto& [index, buffer, written] : d.buffers) {
      const BufferSpec* spec = plan.find_buffer(buffer);
      if (spec == nullptr) {
        throw std::invalid_argument(
            d.kernel + " binds " + to_string(buffer) +
            ", which the plan does not have");
      }
      if (written && spec->role == BufferRole::Input) {
        throw std::invalid_argument(
            d.kernel + " would write its input " + to_string(buffer));
      }
      if (index > kMaxBufferIndex || index == d.params_index) {
        throw std::invalid_argument(
            d.kernel + ": buffer index " + std::to_string(index) + " for " +
            to_string(buffer) + " is out of range or taken");
      }
    }
    if (d.params_index > kMaxBufferIndex) {
      throw std::invalid_argument(
          d.kernel + ": params index over " + std::to_string(kMaxBufferIndex));
    }
    if (d.chunk) {
      const unsigned index = d.chunk->index;
      const bool taken = index == d.params_index ||
          std::any_of(d.buffers.begin(),
                      d.buffers.end(),
                      [&](const Binding& b) { return b.index == index; });
      if (index > kMaxBufferIndex || taken) {
        throw std::invalid_argument(
            d.kernel + ": chunk index " + std::to_string(index) +
            " is out of range or taken");
      }
    }
  }
}

}  // namespace mlx_gated_delta::metal
