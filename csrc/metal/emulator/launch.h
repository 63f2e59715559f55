// One emulated dispatch (`dispatchThreadgroups`): Metal's limits, then every
// threadgroup in turn, each as one OS thread per GPU thread.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <string>

#include "runtime.h"

namespace metal_emulator {

// Metal's limits on Apple GPUs that a plan must respect.
constexpr unsigned kMaxThreadsPerThreadgroup = 1024;
constexpr size_t kMaxThreadgroupMemoryBytes = 32 * 1024;
constexpr unsigned kMaxBufferIndex = 30;

struct Launch {
  std::string kernel;  // host name
  std::array<void*, kMaxBufferIndex + 1> buffers{};
  Extent3 threadgroups;
  Extent3 threads_per_threadgroup;
  size_t threadgroup_memory_bytes = 0;  // what the plan declares
};

// Throws std::invalid_argument for a launch over Metal's limits and
// std::runtime_error for what went wrong inside the kernel (divergence,
// deadlock, threadgroup memory over the declared amount, an exception).
void run_launch(
    const Launch& launch, std::chrono::milliseconds barrier_timeout);

// Used by runtime.cpp and run_launch: threadgroup-array accounting.
void begin_threadgroup_accounting();
size_t threadgroup_bytes_used();
void poison_threadgroup_memory();

}  // namespace metal_emulator
