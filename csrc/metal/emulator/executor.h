// The emulator executor: runs a Metal plan over the .metal sources compiled
// for the CPU, the Linux counterpart of executor_metal.cpp.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "metal/plan.h"

namespace mlx_gated_delta::metal::emulator {

// The call's inputs as raw bytes in the plan's layouts (the mask as one byte
// per token; empty when the plan has no mask).
struct CallInputs {
  std::span<const std::byte> q, k, v, g, beta, mask, state;
};
struct CallOutputs {
  std::vector<std::byte> y;      // [B, T, Hv, Dv] in the activation dtype
  std::vector<std::byte> state;  // [B, Hv, Dv, Dk] float32
};

// Every buffer gets sentinel guard bytes before and after it; after each
// dispatch the guards of every buffer are checked, and after the last one the
// inputs are compared with what was passed in. Outputs and scratch start as
// NaN, so an element no kernel writes shows. Throws std::runtime_error naming
// the dispatch and the buffer on any violation, and whatever run_launch
// throws (limits, divergence, deadlock).
CallOutputs run_plan(const Plan& plan, const CallInputs& inputs,
                     std::chrono::milliseconds barrier_timeout);

}  // namespace mlx_gated_delta::metal::emulator
