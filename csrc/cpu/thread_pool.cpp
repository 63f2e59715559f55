#include "cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "cpu/usable_cores.h"

namespace mlx_gated_delta::cpu {

namespace {

// A worker is worth waking for at least this many multiply-adds (some 30
// to 40 us of decode work on the 2-core EPYC measured): below it, the wake-up,
// and on a busy machine the chance that the worker is preempted in the middle
// of its task while the caller waits for it, cost more than the worker saves
// (docs/cpu.md). On a pool of more than two threads a worker is woken for
// kMinWorkPerThreadLargePool: on the 16-core Xeon measured, Qwen3-Next's
// decode step (2M multiply-adds) took half the time on 16 threads as on the 4
// that 512K gave it, quiet and taking turns with MLX's own ops; on two cores
// 64K made the demo model's decode twice as slow ("How a call is shared").
constexpr int64_t kMinWorkPerThread = 512 * 1024;
constexpr int64_t kMinWorkPerThreadLargePool = 64 * 1024;

// A worker that ran tasks in a job polls for the next job for kWorkerSpin
// (giving the core away between polls) before it sleeps: a decode step calls
// the pool once per layer, and waking a sleeping worker for each call made the
// op's decode step on the quiet 2-core EPYC 1.25x slower than polling did
// (docs/cpu.md). A worker that found nothing to do (it came late: the caller
// had taken every task), or that works for a pool that stalled recently (see
// below), sleeps at once: on a busy machine a polling worker takes the core
// from the threads that make progress. The caller, once the tasks are all
// taken, polls a little for the workers still running one: that wait is a
// task long.
constexpr auto kWorkerSpin = std::chrono::microseconds(200);
constexpr auto kCallerSpin = std::chrono::microseconds(20);

// A worker stalled when the caller, done with its own tasks, waited for it
// longer than kStallWait and longer than its own tasks took: the OS had
// preempted the worker inside a task, and the caller waits for the rest of
// the time slice of whatever runs instead (milliseconds, for a job of a few
// hundred microseconds). For kStallMemory after a stall, jobs of less than
// kSmallJobWork multiply-adds (about a millisecond on one core, a decode
// step's) run on the caller alone; larger jobs still pay for the workers.
// After that the workers are tried again.
//
// On a pool of more than two threads, a wait counts as a stall only past
// kStallWaitLargePool: workers woken on idle virtual CPUs come a few hundred
// microseconds late often enough that, on the quiet 16-core Xeon measured,
// the 100 us threshold kept the decode step on the caller alone for most of a
// run (half the speed). On two cores, 1 ms made the decode step of the busy
// 2-core EPYC 10-20% slower, so it keeps 100 us (docs/cpu.md, "The stall
// threshold"). Pools of 3 to 15 threads were not measured with 100 us.
constexpr auto kStallWait = std::chrono::microseconds(100);
constexpr auto kStallWaitLargePool = std::chrono::microseconds(1000);
constexpr auto kStallMemory = std::chrono::milliseconds(100);
constexpr int64_t kSmallJobWork = 32 * kMinWorkPerThread;

// Waits until ready() holds: polls for `spin` (giving the core away between
// polls), then sleeps on the condition variable. Whoever makes ready() true
// notifies under `mutex`, so the sleeper cannot miss it.
template <typename Ready>
void wait_until(
    std::chrono::microseconds spin,
    std::mutex& mutex,
    std::condition_variable& condition,
    Ready ready) {
  if (spin.count() > 0) {
    const auto spin_end = std::chrono::steady_clock::now() + spin;
    do {
      for (int i = 0; i < 16; ++i) {
        if (ready()) {
          return;
        }
        std::this_thread::yield();
      }
    } while (std::chrono::steady_clock::now() < spin_end);
  }
  std::unique_lock<std::mutex> lock(mutex);
  condition.wait(lock, ready);
}

// How a job is shared. The caller publishes the task and opens the job,
// wakes as many workers as the work pays for, and takes task indices itself
// like any worker: when the OS runs no worker, the caller does all of the work
// and never waits for one. When the indices are exhausted it closes the job
// and waits only for the workers that joined it (they may still be running a
// task). A worker joins by counting itself in `joined_` and then checking
// that the job is open; the caller closes and then reads `joined_`. Both are
// sequentially consistent, so either the worker sees the job closed and
// leaves, or the caller sees it and waits for it.
class ThreadPool {
 public:
  explicit ThreadPool(int threads) {
    for (int i = 1; i < threads; ++i) {
      threads_.emplace_back([this] { worker_loop(); });
    }
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_.store(true);
    }
    wake_.notify_all();
    for (auto& thread : threads_) {
      thread.join();
    }
  }

  int thread_count() const {
    return static_cast<int>(threads_.size()) + 1;
  }

  // More than two threads: the thresholds measured on the 16-core Xeon
  // (kMinWorkPerThreadLargePool, kStallWaitLargePool) instead of the 2-core
  // EPYC's.
  bool large_pool() const {
    return thread_count() > 2;
  }

  // work: the job's multiply-adds, or -1 when the caller did not say (then
  // the job counts as large).
  void run(
      int count,
      int threads,
      int64_t work,
      const std::function<void(int)>& task) {
    if (count <= 0) {
      return;
    }
    threads = std::min({threads, count, thread_count()});
    if (work >= 0 && work < kSmallJobWork && stalled_recently()) {
      threads = 1;
    }
    // One job at a time. A caller that finds the pool busy (another MLX
    // stream's job) runs its own tasks rather than queueing: its thread is
    // running anyway, and the workers stay with one job, so several streams
    // never ask for more threads than the streams plus the pool.
    std::unique_lock<std::mutex> job_lock(job_mutex_, std::defer_lock);
    if (threads <= 1 || !job_lock.try_lock()) {
      for (int i = 0; i < count; ++i) {
        task(i);
      }
      return;
    }
    task_ = &task;
    count_ = count;
    next_.store(0);
    error_ = nullptr;
    seats_.store(threads - 1);
    open_.store(true);
    {
      // Under the mutex, so that a worker about to sleep cannot miss it.
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1);
    }
    if (threads - 1 == static_cast<int>(threads_.size())) {
      wake_.notify_all();
    } else {
      for (int i = 1; i < threads; ++i) {
        wake_.notify_one();
      }
    }
    const auto started = Clock::now();
    drain();
    open_.store(false);
    const auto drained = Clock::now();
    wait_until(
        kCallerSpin, mutex_, left_, [this] { return joined_.load() == 0; });
    const auto waited = Clock::now() - drained;
    const auto stall_wait = large_pool() ? kStallWaitLargePool : kStallWait;
    if (waited > stall_wait && waited > drained - started) {
      const auto until = Clock::now() + kStallMemory;
      small_jobs_alone_until_.store(until.time_since_epoch().count());
    }
    task_ = nullptr;
    if (error_) {
      std::rethrow_exception(error_);
    }
  }

 private:
  using Clock = std::chrono::steady_clock;

  bool stalled_recently() const {
    return Clock::now().time_since_epoch().count() <
        small_jobs_alone_until_.load();
  }

  // Takes task indices until none are left; returns how many it ran.
  int drain() {
    int ran = 0;
    for (int i = next_.fetch_add(1); i < count_; i = next_.fetch_add(1)) {
      try {
        (*task_)(i);
        ++ran;
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) {
          error_ = std::current_exception();
        }
      }
    }
    return ran;
  }

  void worker_loop() {
    uint64_t seen = 0;
    bool worked = false;
    while (true) {
      const bool poll = worked && !stalled_recently();
      wait_until(
          poll ? kWorkerSpin : std::chrono::microseconds(0),
          mutex_,
          wake_,
          [&] { return stopping_.load() || generation_.load() != seen; });
      if (stopping_.load()) {
        return;
      }
      seen = generation_.load();
      joined_.fetch_add(1);
      // A worker woken late finds the job closed (or its seats taken) and
      // goes back to waiting without touching it.
      worked = false;
      if (open_.load() && seats_.fetch_sub(1) > 0) {
        worked = drain() > 0;
      }
      if (joined_.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(mutex_);
        left_.notify_one();
      }
    }
  }

  std::vector<std::thread> threads_;
  std::mutex job_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable left_;
  const std::function<void(int)>* task_ = nullptr;
  int count_ = 0;
  std::atomic<int> next_{0};
  std::atomic<int> seats_{0};
  std::atomic<int> joined_{0};
  std::atomic<bool> open_{false};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stopping_{false};
  // Until when, after a stall, small jobs run on the caller alone (Clock
  // ticks since its epoch). Written by the job's caller only; callers that
  // find the pool busy run alone anyway.
  std::atomic<Clock::rep> small_jobs_alone_until_{0};
  std::exception_ptr error_;
};

ThreadPool& pool() {
  static ThreadPool instance(read_thread_budget().threads);
  return instance;
}

}  // namespace

void parallel_for(int count, const std::function<void(int)>& task) {
  pool().run(count, thread_count(), -1, task);
}

int threads_for_work(int64_t work) {
  const int64_t per_thread =
      pool().large_pool() ? kMinWorkPerThreadLargePool : kMinWorkPerThread;
  const int64_t threads = std::max<int64_t>(1, work / per_thread);
  return static_cast<int>(std::min<int64_t>(threads, thread_count()));
}

void parallel_for(
    int count, int64_t task_work, const std::function<void(int)>& task) {
  const int64_t work = std::max<int64_t>(0, task_work) * std::max(count, 0);
  pool().run(count, threads_for_work(work), work, task);
}

int thread_count() {
  return pool().thread_count();
}

}  // namespace mlx_gated_delta::cpu
