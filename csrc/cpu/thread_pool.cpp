#include "cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace mlx_gated_delta::cpu {

namespace {

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
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& thread : threads_) {
      thread.join();
    }
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
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = &task;
      count_ = count;
      next_.store(0);
      active_workers_ = static_cast<int>(threads_.size());
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return active_workers_ == 0; });
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
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) {
          return;
        }
        seen = generation_;
      }
      drain();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (--active_workers_ == 0) {
          done_.notify_one();
        }
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
  int active_workers_ = 0;
  uint64_t generation_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
};

}  // namespace

void parallel_for(int count, const std::function<void(int)>& task) {
  static ThreadPool pool;
  pool.run(count, task);
}

}  // namespace mlx_gated_delta::cpu
