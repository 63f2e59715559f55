#include "cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace mlx_gated_delta::cpu {

namespace {

// Waits until ready() holds, first by spinning for a short while, then asleep
// on the condition variable. Decode steps call the pool every few hundred
// microseconds; waking a sleeping thread costs tens of microseconds on the
// machines measured, so a short spin keeps the workers ready for the next call.
template <typename Ready>
void wait_until(
    std::mutex& mutex, std::condition_variable& condition, Ready ready) {
  constexpr auto kSpin = std::chrono::microseconds(200);
  const auto spin_end = std::chrono::steady_clock::now() + kSpin;
  while (!ready()) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) {
        return;
      }
      std::this_thread::yield();
    }
    if (std::chrono::steady_clock::now() > spin_end) {
      std::unique_lock<std::mutex> lock(mutex);
      condition.wait(lock, ready);
      return;
    }
  }
}

class ThreadPool {
 public:
  ThreadPool() {
    const int workers =
        std::max(1, static_cast<int>(std::thread::hardware_concurrency())) - 1;
    for (int i = 0; i < workers; ++i) {
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

  void run(int count, const std::function<void(int)>& task) {
    if (count <= 0) {
      return;
    }
    if (threads_.empty() || count == 1) {
      for (int i = 0; i < count; ++i) {
        task(i);
      }
      return;
    }
    // One job at a time: callers from several MLX streams queue up here.
    std::lock_guard<std::mutex> job_lock(job_mutex_);
    task_ = &task;
    count_ = count;
    next_.store(0);
    error_ = nullptr;
    active_workers_.store(static_cast<int>(threads_.size()));
    {
      // Under the mutex, so that a worker about to sleep cannot miss it.
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    drain();
    wait_until(mutex_, done_, [this] { return active_workers_.load() == 0; });
    task_ = nullptr;
    if (error_) {
      std::rethrow_exception(error_);
    }
  }

 private:
  // Takes task indices until none are left.
  void drain() {
    for (int i = next_.fetch_add(1); i < count_; i = next_.fetch_add(1)) {
      try {
        (*task_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) {
          error_ = std::current_exception();
        }
      }
    }
  }

  void worker_loop() {
    uint64_t seen = 0;
    while (true) {
      wait_until(mutex_, wake_, [&] {
        return stopping_.load() || generation_.load() != seen;
      });
      if (stopping_.load()) {
        return;
      }
      seen = generation_.load();
      drain();
      if (active_workers_.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(mutex_);
        done_.notify_one();
      }
    }
  }

  std::vector<std::thread> threads_;
  std::mutex job_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int)>* task_ = nullptr;
  int count_ = 0;
  std::atomic<int> next_{0};
  std::atomic<int> active_workers_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stopping_{false};
  std::exception_ptr error_;
};

ThreadPool& pool() {
  static ThreadPool instance;
  return instance;
}

}  // namespace

void parallel_for(int count, const std::function<void(int)>& task) {
  pool().run(count, task);
}

int thread_count() {
  return pool().thread_count();
}

}  // namespace mlx_gated_delta::cpu
