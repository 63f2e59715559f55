#include "runtime.h"

#include <map>
#include <sstream>

#include "dispatch.h"

namespace metal_emulator {

void DispatchStatus::fail(const std::string& message) {
  std::lock_guard lock(mutex_);
  if (!failed_.load(std::memory_order_relaxed)) {
    message_ = message;
    failed_.store(true, std::memory_order_release);
  }
}

std::string DispatchStatus::message() const {
  std::lock_guard lock(mutex_);
  return message_;
}

namespace {
std::string describe(const std::source_location& where) {
  std::ostringstream text;
  text << where.file_name() << ":" << where.line();
  return text.str();
}
}  // namespace

Barrier::Barrier(
    const char* what,
    unsigned participants,
    DispatchStatus& status,
    std::chrono::milliseconds timeout)
    : what_(what),
      participants_(participants),
      status_(status),
      timeout_(timeout) {}

void Barrier::check_left_behind(Phase& phase) {
  unsigned left = left_.load(std::memory_order_acquire);
  if (phase.arrived > 0 && left > 0 && phase.arrived + left == participants_) {
    std::ostringstream text;
    text << "divergent " << what_ << ": " << phase.arrived
         << " thread(s) wait at " << describe(phase.first_arrival) << " but "
         << left << " thread(s) returned from the kernel without reaching it";
    status_.fail(text.str());
    phase.changed.notify_all();
  }
}

void Barrier::arrive_and_wait(
    unsigned& parity, const std::source_location& where) {
  Phase& phase = phases_[parity];
  parity ^= 1u;
  std::unique_lock lock(phase.mutex);
  if (status_.failed())
    throw AbortDispatch{};
  if (phase.arrived == 0) {
    phase.first_arrival = where;
  } else if (
      phase.first_arrival.line() != where.line() ||
      std::strcmp(phase.first_arrival.file_name(), where.file_name()) != 0) {
    std::ostringstream text;
    text << "divergent " << what_ << ": reached from "
         << describe(phase.first_arrival) << " and from " << describe(where);
    status_.fail(text.str());
    phase.changed.notify_all();
    throw AbortDispatch{};
  }
  uint64_t generation = phase.generation;
  if (++phase.arrived == participants_) {
    phase.arrived = 0;
    ++phase.generation;
    phase.changed.notify_all();
    return;
  }
  check_left_behind(phase);
  // Waits in short slices so that a failure elsewhere in the dispatch (an
  // exception, divergence at another barrier) ends this wait at once.
  constexpr auto kSlice = std::chrono::milliseconds(20);
  auto deadline = std::chrono::steady_clock::now() + timeout_;
  while (phase.generation == generation) {
    if (status_.failed())
      throw AbortDispatch{};
    if (std::chrono::steady_clock::now() >= deadline) {
      std::ostringstream text;
      text << what_ << " at " << describe(phase.first_arrival)
           << " did not complete within " << timeout_.count() << " ms ("
           << phase.arrived << " of " << participants_
           << " threads arrived): deadlock";
      status_.fail(text.str());
      phase.changed.notify_all();
      throw AbortDispatch{};
    }
    phase.changed.wait_for(lock, kSlice);
  }
}

void Barrier::leave() {
  left_.fetch_add(1, std::memory_order_acq_rel);
  for (Phase& phase : phases_) {
    std::lock_guard lock(phase.mutex);
    check_left_behind(phase);
  }
}

namespace {
thread_local ThreadContext* current = nullptr;

struct ThreadgroupArrays {
  std::mutex mutex;
  std::map<void*, size_t> every_array;  // all ever seen, for poisoning
  std::map<void*, size_t> this_dispatch;  // for measuring the dispatch's usage
};
ThreadgroupArrays& threadgroup_arrays() {
  static ThreadgroupArrays arrays;
  return arrays;
}

std::map<std::string, KernelEntry>& kernel_table() {
  static std::map<std::string, KernelEntry> table;
  return table;
}
}  // namespace

ThreadContext& current_thread() {
  if (current == nullptr) {
    throw std::logic_error(
        "a Metal built-in was used outside an emulated GPU thread");
  }
  return *current;
}

void set_current_thread(ThreadContext* context) {
  current = context;
}

void register_threadgroup_array(void* address, size_t bytes) {
  auto& arrays = threadgroup_arrays();
  std::lock_guard lock(arrays.mutex);
  arrays.every_array[address] = bytes;
  arrays.this_dispatch[address] = bytes;
}

void begin_threadgroup_accounting() {
  auto& arrays = threadgroup_arrays();
  std::lock_guard lock(arrays.mutex);
  arrays.this_dispatch.clear();
}

size_t threadgroup_bytes_used() {
  auto& arrays = threadgroup_arrays();
  std::lock_guard lock(arrays.mutex);
  size_t total = 0;
  for (const auto& [address, bytes] : arrays.this_dispatch)
    total += bytes;
  return total;
}

void poison_threadgroup_memory() {
  auto& arrays = threadgroup_arrays();
  std::lock_guard lock(arrays.mutex);
  // All-ones bytes are a NaN in every float format: a kernel that reads
  // threadgroup memory it did not write in this threadgroup sees NaN.
  for (const auto& [address, bytes] : arrays.every_array)
    std::memset(address, 0xff, bytes);
}

KernelRegistration::KernelRegistration(
    const char* host_name, KernelEntry entry) {
  kernel_table()[host_name] = entry;
}

KernelEntry find_kernel(const std::string& host_name) {
  auto found = kernel_table().find(host_name);
  if (found == kernel_table().end()) {
    throw std::invalid_argument(
        "metal emulator: no kernel named '" + host_name + "'");
  }
  return found->second;
}

// An unbound index yields nullptr, as an optional buffer (the mask) may be
// declared but left unbound when the kernel never reads it.
void* bound_buffer(unsigned index) {
  return current_thread().buffers[index];
}

}  // namespace metal_emulator
