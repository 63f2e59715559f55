#include "dispatch.h"

#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

namespace metal_emulator {

namespace {

void check_limits(const Dispatch& dispatch) {
  uint64_t threads = dispatch.threads_per_threadgroup.count();
  if (threads == 0 || threads > kMaxThreadsPerThreadgroup) {
    throw std::invalid_argument(
        "metal emulator: " + dispatch.kernel + " asks for " +
        std::to_string(threads) +
        " threads per threadgroup (Metal allows 1 to " +
        std::to_string(kMaxThreadsPerThreadgroup) + ")");
  }
  if (dispatch.threadgroup_memory_bytes > kMaxThreadgroupMemoryBytes) {
    throw std::invalid_argument(
        "metal emulator: " + dispatch.kernel + " declares " +
        std::to_string(dispatch.threadgroup_memory_bytes) +
        " bytes of threadgroup memory (Metal allows " +
        std::to_string(kMaxThreadgroupMemoryBytes) + ")");
  }
}

// Runs one threadgroup to completion; returns the first error or "".
std::string run_threadgroup(
    const Dispatch& dispatch,
    KernelEntry entry,
    Extent3 group,
    std::chrono::milliseconds timeout) {
  const Extent3 size = dispatch.threads_per_threadgroup;
  const unsigned threads = unsigned(size.count());
  DispatchStatus status;
  Barrier barrier("threadgroup_barrier", threads, status, timeout);
  std::vector<std::unique_ptr<SimdGroup>> simdgroups;
  for (unsigned first = 0; first < threads; first += kSimdWidth) {
    simdgroups.push_back(std::make_unique<SimdGroup>(
        std::min(kSimdWidth, threads - first), status, timeout));
  }
  std::vector<ThreadContext> contexts(threads);
  for (unsigned index = 0; index < threads; ++index) {
    ThreadContext& context = contexts[index];
    Extent3 local{
        index % size.x, (index / size.x) % size.y, index / (size.x * size.y)};
    context.thread_position_in_threadgroup = local;
    context.threadgroup_position_in_grid = group;
    context.threads_per_threadgroup = size;
    context.threadgroups_per_grid = dispatch.threadgroups;
    context.thread_position_in_grid = {
        group.x * size.x + local.x,
        group.y * size.y + local.y,
        group.z * size.z + local.z};
    context.thread_index_in_threadgroup = index;
    context.thread_index_in_simdgroup = index % kSimdWidth;
    context.simdgroup_index_in_threadgroup = index / kSimdWidth;
    context.buffers = dispatch.buffers.data();
    context.threadgroup_barrier = &barrier;
    context.simdgroup = simdgroups[index / kSimdWidth].get();
    context.threads_per_simdgroup = context.simdgroup->width();
  }
  std::vector<std::thread> workers;
  workers.reserve(threads);
  for (unsigned index = 0; index < threads; ++index) {
    workers.emplace_back([&, index] {
      ThreadContext& context = contexts[index];
      set_current_thread(&context);
      try {
        entry();
      } catch (const AbortDispatch&) {
      } catch (const std::exception& error) {
        status.fail(dispatch.kernel + ": " + error.what());
      }
      context.simdgroup->leave();
      barrier.leave();
      set_current_thread(nullptr);
    });
  }
  for (auto& worker : workers)
    worker.join();
  return status.failed() ? status.message() : std::string();
}

}  // namespace

void run_dispatch(
    const Dispatch& dispatch, std::chrono::milliseconds barrier_timeout) {
  check_limits(dispatch);
  KernelEntry entry = find_kernel(dispatch.kernel);
  // Threadgroup arrays are process-wide statics: one threadgroup at a time in
  // the whole process, even when several host threads dispatch.
  static std::mutex one_dispatch_at_a_time;
  std::lock_guard lock(one_dispatch_at_a_time);
  begin_threadgroup_accounting();
  const Extent3 grid = dispatch.threadgroups;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        poison_threadgroup_memory();
        std::string error =
            run_threadgroup(dispatch, entry, {x, y, z}, barrier_timeout);
        if (!error.empty()) {
          std::ostringstream text;
          text << "metal emulator: " << dispatch.kernel << " threadgroup (" << x
               << ", " << y << ", " << z << "): " << error;
          throw std::runtime_error(text.str());
        }
        size_t used = threadgroup_bytes_used();
        if (used > dispatch.threadgroup_memory_bytes) {
          throw std::runtime_error(
              "metal emulator: " + dispatch.kernel + " used " +
              std::to_string(used) +
              " bytes of threadgroup memory but its plan declares " +
              std::to_string(dispatch.threadgroup_memory_bytes));
        }
      }
    }
  }
}

}  // namespace metal_emulator
