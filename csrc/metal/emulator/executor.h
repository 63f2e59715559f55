// The emulator executor: runs a Metal plan over the .metal sources compiled
// for the CPU, the Linux counterpart of executor_metal.cpp.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "metal/plan/plan.h"

namespace mlx_gated_delta::metal::emulator {

// Raw bytes per plan buffer, in the plan's layouts (a mask is one byte per
// token).
using BufferInputs = std::map<PlanBuffer, std::span<const std::byte>>;
using BufferOutputs = std::map<PlanBuffer, std::vector<std::byte>>;

// Runs every dispatch of `plan`; `inputs` holds exactly the plan's input
// buffers, and the result its output buffers. Every buffer gets sentinel
// guard bytes before and after it; after each dispatch the guards of every
// buffer are checked, and after the last one the inputs are compared with
// what was passed in. Outputs and scratch start as NaN, so an element no
// kernel writes shows. Throws std::runtime_error naming the dispatch and the
// buffer on any violation, and whatever run_dispatch throws (limits,
// divergence, deadlock).
//
// With `through_stage`, only the dispatches up to and including the first of
// that stage run, and the result holds the scratch buffers besides the
// outputs: what the stages so far wrote, for the per-stage tests. Throws
// std::invalid_argument when no dispatch has that stage.
BufferOutputs run_plan(
    const Plan& plan,
    const BufferInputs& inputs,
    std::chrono::milliseconds barrier_timeout,
    const std::string& through_stage = {});

}  // namespace mlx_gated_delta::metal::emulator
