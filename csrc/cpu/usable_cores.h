// How many threads the CPU kernels may use: the cores this process is allowed
// to run on (its affinity mask), bounded by its cgroup's CPU quota, unless the
// environment variable MLX_GATED_DELTA_NUM_THREADS sets the count.
#pragma once

#include <optional>
#include <string>

namespace mlx_gated_delta::cpu {

// The CPUs a cgroup v2 `cpu.max` file grants ("<quota> <period>" in
// microseconds, or "max <period>" for no limit), rounded up to whole CPUs:
// nullopt for no limit or for text that is not in that form.
std::optional<int> cpus_of_cgroup_cpu_max(const std::string& text);

// The CPUs the quota of cgroup v1's cpu controller grants
// (cpu.cfs_quota_us, -1 for no limit; cpu.cfs_period_us), rounded up:
// nullopt for no limit or unreadable values.
std::optional<int> cpus_of_cfs_quota(
    const std::string& quota_text, const std::string& period_text);

// Where the thread count comes from, and the count.
struct ThreadBudget {
  int threads;  // at least 1
  int affinity_cpus;  // CPUs in the affinity mask (the hardware's elsewhere)
  std::optional<int> quota_cpus;  // the cgroup quota, where one is set
  std::optional<int> requested;  // MLX_GATED_DELTA_NUM_THREADS, where valid
};

// Read from the process's affinity mask, its cgroup and the environment now.
ThreadBudget read_thread_budget();

}  // namespace mlx_gated_delta::cpu
