#include "cpu/usable_cores.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

namespace mlx_gated_delta::cpu {

namespace {

// A whole decimal integer, surrounding whitespace allowed.
std::optional<long long> parse_integer(const std::string& text) {
  const auto first = text.find_first_not_of(" \t\n");
  const auto last = text.find_last_not_of(" \t\n");
  if (first == std::string::npos) {
    return std::nullopt;
  }
  long long value = 0;
  const char* begin = text.data() + first;
  const char* end = text.data() + last + 1;
  const auto [stop, error] = std::from_chars(begin, end, value);
  if (error != std::errc() || stop != end) {
    return std::nullopt;
  }
  return value;
}

// quota / period CPUs, rounded up: a quota of 1.5 CPUs still runs two
// threads at once, each for part of the time.
std::optional<int> cpus_of_quota(long long quota, long long period) {
  if (quota <= 0 || period <= 0) {
    return std::nullopt;
  }
  return static_cast<int>(std::max(1LL, (quota + period - 1) / period));
}

std::optional<std::string> read_file(const std::string& path) {
  std::ifstream file(path);
  if (!file) {
    return std::nullopt;
  }
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

std::optional<int> smaller(std::optional<int> a, std::optional<int> b) {
  if (!a) {
    return b;
  }
  if (!b) {
    return a;
  }
  return std::min(*a, *b);
}

// The tightest quota on the way from `directory` (a cgroup's directory under
// `root`) up to `root`: a parent's limit binds its children too. `read`
// gives the CPUs one directory's files grant.
template <typename Read>
std::optional<int> tightest_quota(
    const std::string& root, std::string directory, Read read) {
  std::optional<int> cpus;
  while (true) {
    cpus = smaller(cpus, read(root + directory));
    if (directory.empty() || directory == "/") {
      return cpus;
    }
    const auto slash = directory.find_last_of('/');
    directory = slash == std::string::npos ? "" : directory.substr(0, slash);
  }
}

// The quota of the process's cgroup, from /proc/self/cgroup: the v2 line
// "0::<path>", or the v1 line whose controllers include "cpu".
std::optional<int> cgroup_quota_cpus() {
  const auto membership = read_file("/proc/self/cgroup");
  if (!membership) {
    return std::nullopt;
  }
  std::optional<int> cpus;
  std::istringstream lines(*membership);
  for (std::string line; std::getline(lines, line);) {
    const auto first = line.find(':');
    const auto second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) {
      continue;
    }
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const std::string path = line.substr(second + 1);
    if (controllers.empty()) {
      for (const char* root : {"/sys/fs/cgroup", "/sys/fs/cgroup/unified"}) {
        cpus = smaller(cpus, tightest_quota(root, path, [](const auto& dir) {
                         const auto text = read_file(dir + "/cpu.max");
                         return text ? cpus_of_cgroup_cpu_max(*text)
                                     : std::nullopt;
                       }));
      }
      continue;
    }
    std::istringstream names(controllers);
    bool has_cpu = false;
    for (std::string name; std::getline(names, name, ',');) {
      has_cpu = has_cpu || name == "cpu";
    }
    if (!has_cpu) {
      continue;
    }
    for (const char* root :
         {"/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"}) {
      cpus =
          smaller(cpus, tightest_quota(root, path, [](const auto& dir) {
                    const auto quota = read_file(dir + "/cpu.cfs_quota_us");
                    const auto period = read_file(dir + "/cpu.cfs_period_us");
                    return quota && period ? cpus_of_cfs_quota(*quota, *period)
                                           : std::nullopt;
                  }));
    }
  }
  return cpus;
}

int affinity_cpus() {
#if defined(__linux__)
  cpu_set_t mask;
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) {
    return std::max(1, CPU_COUNT(&mask));
  }
#endif
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

std::optional<int> requested_threads() {
  const char* text = std::getenv("MLX_GATED_DELTA_NUM_THREADS");
  if (text == nullptr || *text == '\0') {
    return std::nullopt;
  }
  const auto value = parse_integer(text);
  if (!value || *value < 1 || *value > 4096) {
    std::fprintf(
        stderr,
        "mlx_gated_delta: ignoring MLX_GATED_DELTA_NUM_THREADS=%s (not a "
        "whole number from 1 to 4096)\n",
        text);
    return std::nullopt;
  }
  return static_cast<int>(*value);
}

}  // namespace

std::optional<int> cpus_of_cgroup_cpu_max(const std::string& text) {
  std::istringstream fields(text);
  std::string quota, period, extra;
  if (!(fields >> quota >> period) || (fields >> extra)) {
    return std::nullopt;
  }
  const auto period_us = parse_integer(period);
  if (quota == "max" || !period_us) {
    return std::nullopt;
  }
  const auto quota_us = parse_integer(quota);
  return quota_us ? cpus_of_quota(*quota_us, *period_us) : std::nullopt;
}

std::optional<int> cpus_of_cfs_quota(
    const std::string& quota_text, const std::string& period_text) {
  // A quota of -1 (no limit) grants no count: cpus_of_quota reads it as none.
  const auto quota = parse_integer(quota_text);
  const auto period = parse_integer(period_text);
  return quota && period ? cpus_of_quota(*quota, *period) : std::nullopt;
}

ThreadBudget read_thread_budget() {
  ThreadBudget budget;
  budget.affinity_cpus = affinity_cpus();
  budget.quota_cpus = cgroup_quota_cpus();
  budget.requested = requested_threads();
  budget.threads = budget.requested
      ? *budget.requested
      : std::min(budget.affinity_cpus, budget.quota_cpus.value_or(4096));
  return budget;
}

}  // namespace mlx_gated_delta::cpu
