// A fixed pool of worker threads for one KV store: run(fn) calls fn(0) on the caller and
// fn(tid) on each worker that starts before fn(0) returns, and returns when those are done.
// A worker not yet running then (its CPU busy elsewhere: the S-Part may share these cores)
// sits the job out, so fn must let any subset of threads with 0 among them do all the work
// (take it from a shared counter). Workers spin briefly after a job (decode calls come per
// layer, back to back) and then sleep on a condition variable. They keep off the caller's
// CPU (keep_off).
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
  void keep_off(int cpu);

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void(int)>* fn_ = nullptr;
  std::atomic<uint64_t> gen_{0};
  bool closed_ = false;    // fn(0) has returned: workers not yet in sit this job out
  int entered_ = 0;        // workers in this job; closed_, entered_ under mu_
  std::atomic<int> done_{0};  // of them, those done
  int caller_cpu_ = -1;  // the CPU the workers keep off (keep_off), -1: none
  bool stop_ = false;
};

}  // namespace fd
