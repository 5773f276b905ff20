// A fixed pool of worker threads for one KV store: run(fn) calls fn(0) on the caller and
// fn(tid) on each worker that starts before fn(0) returns, and returns when those are done.
// A worker not yet running then (its CPU busy elsewhere: the S-Part may share these cores)
// sits the job out, so fn must let any subset of threads with 0 among them do all the work
// (take it from a shared counter). Workers spin briefly after a job (decode calls come per
// layer, back to back) and then sleep on a condition variable. They keep off the caller's
// CPU (keep_off).
//
// With `openmp`, the pool has no threads of its own: run(fn) is an OpenMP parallel region of
// num_threads. In a process that has loaded torch first, that is torch's own team (this module
// and torch then share one libgomp, matched by its soname), so the kernel, called between the
// S-Part's ops on the same cores, runs on the threads torch's ops have just left, instead of
// competing with them (they spin after each op) from a second pool.
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
  explicit ThreadPool(int num_threads, bool openmp = false);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return openmp_ ? openmp_threads_ : static_cast<int>(threads_.size()) + 1; }
  bool openmp() const { return openmp_; }
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
  bool openmp_ = false;
  int openmp_threads_ = 1;
  int caller_cpu_ = -1;  // the CPU the workers keep off (keep_off), -1: none
  bool stop_ = false;
};

}  // namespace fd
