// nanobind module _mlx_gated_delta_ext (re-exported as mlx_gated_delta._ext).
// The Python package wraps these; see mlx_gated_delta/ops.py for the
// documented entry points. Each subject binds its own functions
// (bindings.h).
#include "bindings.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/kernel_level.h"
#include "cpu/thread_pool.h"
#include "cpu/usable_cores.h"

namespace nb = nanobind;
using namespace mlx_gated_delta;

NB_MODULE(_mlx_gated_delta_ext, m) {
  m.doc() =
      "C++ core of mlx_gated_delta (use the functions of mlx_gated_delta).";

  // std::domain_error marks a wrong dtype/type: Python sees TypeError.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::domain_error& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    }
  });

  bind_segment(m);
  bind_core(m);
  bind_test_hooks(m);

  // The CPU kernels' thread count (mlx_gated_delta.thread_count()).
  m.def(
      "cpu_thread_count",
      &cpu::thread_count,
      "How many threads the CPU kernels run on at most: "
      "MLX_GATED_DELTA_NUM_THREADS where set, else the CPUs of the affinity "
      "mask bounded by the cgroup's CPU quota. Fixed when the pool starts.");
  // The compiled copy of the CPU kernels that runs (docs/cpu.md).
  m.def(
      "cpu_kernel_level",
      [] { return cpu::kernel_level_name(cpu::kernel_level()); },
      "The instruction-set level of the CPU kernels that run: "
      "MLX_GATED_DELTA_CPU_LEVEL where it names a runnable level, else the "
      "highest this build holds and this CPU runs. Fixed on the first call.");
  m.def(
      "cpu_kernel_levels",
      [] {
        std::vector<std::string> names;
        for (cpu::KernelLevel level : cpu::runnable_kernel_levels()) {
          names.push_back(cpu::kernel_level_name(level));
        }
        return names;
      },
      "The levels this build holds that this CPU runs, lowest first.");
  m.def(
      "cpu_thread_budget",
      [] {
        const cpu::ThreadBudget budget = cpu::read_thread_budget();
        nb::dict out;
        out["threads"] = budget.threads;
        out["affinity_cpus"] = budget.affinity_cpus;
        out["quota_cpus"] = budget.quota_cpus;
        out["requested"] = budget.requested;
        return out;
      },
      "Where the thread count comes from, read now: threads, affinity_cpus, "
      "quota_cpus (None without a cgroup quota), requested "
      "(MLX_GATED_DELTA_NUM_THREADS, None when unset or invalid).");
}
