// A small persistent worker pool for the CPU kernels.
//
// MLX runs a primitive's CPU work on one scheduler thread per stream; the
// gated-delta kernels split their independent (batch row, value head) problems
// across the cores themselves. Workers are created once and reused, so a decode
// step does not pay for thread creation. docs/cpu.md gives the policy (how
// many threads, how they wait) and the measurements behind it.
#pragma once

#include <cstdint>
#include <functional>

namespace mlx_gated_delta::cpu {

// Calls task(i) for every i in [0, count), spread over the pool's workers and
// the calling thread; returns when all are done. Task i always runs entirely on
// one thread, so results do not depend on the number of threads or on which
// thread runs which task.
//
// task_work is about how many multiply-adds one task does: a call whose whole
// work is too small to pay for waking a worker runs on fewer threads (on the
// caller alone when it is tiny). Without it, the work counts as large.
void parallel_for(int count, const std::function<void(int)>& task);
void parallel_for(
    int count, int64_t task_work, const std::function<void(int)>& task);

// How many threads parallel_for(count, task_work, task) asks for, for a job of
// `work` = count * task_work multiply-adds, at most thread_count() (run takes
// fewer when there are fewer tasks).
int threads_for_work(int64_t work);

// How many threads parallel_for runs on at most (the workers and the caller):
// MLX_GATED_DELTA_NUM_THREADS where set, else the CPUs of the process's
// affinity mask, bounded by its cgroup's CPU quota (csrc/cpu/usable_cores.h).
int thread_count();

}  // namespace mlx_gated_delta::cpu
