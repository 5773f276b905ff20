// A fixed pool of worker threads for one KV store: run(fn) calls fn(tid) for
// tid in [0, size()) with the caller as thread 0, and returns when all are done.
// Workers spin briefly after a job (decode calls come per layer, back to back)
// and then sleep on a condition variable.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace fd {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(threads_.size()) + 1; }
  void run(const std::function<void(int)>& fn);

  static int default_threads();  // CPUs this process may run on

 private:
  void worker(int tid);

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void(int)>* fn_ = nullptr;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0};
  bool stop_ = false;
};

}  // namespace fd
