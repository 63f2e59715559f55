// One emulated dispatch (`dispatchThreadgroups`): Metal's limits, then every
// threadgroup in turn, each as one OS thread per GPU thread. A plan's
// Dispatch (metal/plan/plan.h) names its buffers; the emulator's binds them
// to memory.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <string>

#include "metal/plan/plan.h"
#include "runtime.h"

namespace metal_emulator {

// Metal's limits, as the plans are held to them (metal/plan/plan.h).
using mlx_gated_delta::metal::kMaxBufferIndex;
using mlx_gated_delta::metal::kMaxThreadgroupMemoryBytes;
using mlx_gated_delta::metal::kMaxThreadsPerThreadgroup;

struct Dispatch {
  std::string kernel;  // host name
  std::array<void*, kMaxBufferIndex + 1> buffers{};
  Extent3 threadgroups;
  Extent3 threads_per_threadgroup;
  size_t threadgroup_memory_bytes = 0;  // what the plan declares
};

// Throws std::invalid_argument for a dispatch over Metal's limits and
// std::runtime_error for what went wrong inside the kernel (divergence,
// deadlock, threadgroup memory over the declared amount, an exception).
void run_dispatch(
    const Dispatch& dispatch, std::chrono::milliseconds barrier_timeout);

// Used by runtime.cpp and run_dispatch: threadgroup-array accounting.
void begin_threadgroup_accounting();
size_t threadgroup_bytes_used();
void poison_threadgroup_memory();

}  // namespace metal_emulator
