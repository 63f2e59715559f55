// A small persistent worker pool for the CPU kernels.
//
// MLX runs a primitive's CPU work on one scheduler thread per stream; the
// gated-delta kernels split their independent (batch row, value head) problems
// across the cores themselves. Workers are created once and reused, so a decode
// step does not pay for thread creation.
#pragma once

#include <functional>

namespace mlx_gated_delta::cpu {

// Calls task(i) for every i in [0, count), spread over the pool's workers and
// the calling thread; returns when all are done. Task i always runs entirely on
// one thread, so results do not depend on the number of threads.
void parallel_for(int count, const std::function<void(int)>& task);

// How many threads parallel_for runs on (the workers and the caller).
int thread_count();

}  // namespace mlx_gated_delta::cpu
