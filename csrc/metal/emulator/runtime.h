// The thread-level runtime of the Metal emulator: what a GPU thread sees while
// it runs a kernel (its built-in positions, its SIMD-group, its threadgroup)
// and the synchronisation that Metal's barriers and SIMD collectives need.
//
// Every GPU thread of a threadgroup is a real OS thread, so barriers and
// collectives are real synchronisation that ThreadSanitizer can reason about.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <source_location>
#include <stdexcept>
#include <string>

namespace metal_emulator {

constexpr unsigned kSimdWidth = 32;

// Raised inside a GPU thread to unwind it after another thread of the same
// dispatch failed (divergence, deadlock, a thrown error); the first error is
// what the executor reports.
struct AbortDispatch {};

struct Extent3 {
  unsigned x = 1, y = 1, z = 1;
  uint64_t count() const {
    return uint64_t(x) * y * z;
  }
};

// Shared by all threads of one dispatch: the first error wins and wakes every
// waiter so the dispatch ends instead of hanging.
class DispatchStatus {
 public:
  void fail(const std::string& message);
  bool failed() const {
    return failed_.load(std::memory_order_acquire);
  }
  std::string message() const;

 private:
  mutable std::mutex mutex_;
  std::string message_;
  std::atomic<bool> failed_{false};
};

// A barrier among a fixed number of OS threads. Two alternating
// mutex/condvar pairs: with a single pair, threads waking late from one
// barrier would create happens-before edges with threads already waiting at
// the next one, hiding a missing-barrier race from ThreadSanitizer.
//
// Every arrival names its source line: arrivals of one barrier instance from
// two different lines are divergence, and a thread that returns from the
// kernel while others wait is reported too.
class Barrier {
 public:
  Barrier(
      const char* what,
      unsigned participants,
      DispatchStatus& status,
      std::chrono::milliseconds timeout);

  // `phase` is the caller's own parity bit for this barrier (0 or 1).
  void arrive_and_wait(unsigned& phase, const std::source_location& where);
  // The calling thread has returned from the kernel.
  void leave();

 private:
  struct Phase {
    std::mutex mutex;
    std::condition_variable changed;
    unsigned arrived = 0;
    uint64_t generation = 0;
    std::source_location first_arrival;
  };
  void check_left_behind(Phase& phase);  // caller holds phase.mutex

  const char* what_;
  unsigned participants_;
  std::atomic<unsigned> left_{0};
  DispatchStatus& status_;
  std::chrono::milliseconds timeout_;
  std::array<Phase, 2> phases_;
};

// The lanes of one SIMD-group: a barrier plus one exchange slot per lane.
class SimdGroup {
 public:
  static constexpr size_t kSlotBytes =
      16;  // the widest value exchanged: float4

  SimdGroup(
      unsigned width, DispatchStatus& status, std::chrono::milliseconds timeout)
      : width_(width),
        barrier_("SIMD-group collective", width, status, timeout) {}

  unsigned width() const {
    return width_;
  }
  // Publishes `value` from `lane`, waits for every lane, then calls
  // read(slots) and waits again so no lane overwrites a slot still being read.
  template <typename T, typename Read>
  auto exchange(
      unsigned lane,
      unsigned& phase,
      const T& value,
      const std::source_location& where,
      Read read) {
    static_assert(sizeof(T) <= kSlotBytes);
    std::memcpy(slots_[lane].data(), &value, sizeof(T));
    barrier_.arrive_and_wait(phase, where);
    auto result = read(*this);
    barrier_.arrive_and_wait(phase, where);
    return result;
  }
  template <typename T>
  T slot(unsigned lane) const {
    T value;
    std::memcpy(&value, slots_[lane].data(), sizeof(T));
    return value;
  }
  void leave() {
    barrier_.leave();
  }

 private:
  unsigned width_;
  Barrier barrier_;
  std::array<std::array<unsigned char, kSlotBytes>, kSimdWidth> slots_{};
};

// What one GPU thread knows about itself; reached by the shim through a
// thread_local pointer, since kernels call collectives without a handle.
struct ThreadContext {
  Extent3 thread_position_in_grid;
  Extent3 thread_position_in_threadgroup;
  Extent3 threadgroup_position_in_grid;
  Extent3 threads_per_threadgroup;
  Extent3 threadgroups_per_grid;
  unsigned thread_index_in_threadgroup = 0;
  unsigned thread_index_in_simdgroup = 0;
  unsigned simdgroup_index_in_threadgroup = 0;
  unsigned threads_per_simdgroup = kSimdWidth;
  void* const* buffers = nullptr;  // indexed by [[buffer(n)]]
  Barrier* threadgroup_barrier = nullptr;
  unsigned threadgroup_barrier_phase = 0;
  SimdGroup* simdgroup = nullptr;
  unsigned simdgroup_phase = 0;
};

ThreadContext& current_thread();
void set_current_thread(ThreadContext* context);

// Threadgroup arrays become function-local statics (threadgroups run one at a
// time); each registers itself so the executor can measure the threadgroup
// memory a kernel really uses and poison it between threadgroups.
void register_threadgroup_array(void* address, size_t bytes);

// A kernel as the generated wrapper exposes it: reads its arguments from the
// current thread's context.
using KernelEntry = void (*)();

struct KernelRegistration {
  KernelRegistration(const char* host_name, KernelEntry entry);
};

KernelEntry find_kernel(const std::string& host_name);

// Helpers the generated wrappers use to turn bound buffers into arguments.
struct BufferPointer {
  void* address;
  template <typename T>
  operator T*() const {
    return static_cast<T*>(address);
  }
};
struct BufferReference {
  void* address;
  template <typename T>
  operator T&() const {
    return *static_cast<T*>(address);
  }
};
void* bound_buffer(unsigned index);

}  // namespace metal_emulator
