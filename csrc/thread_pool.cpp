#include "thread_pool.h"

#include <sched.h>

#include <chrono>

namespace fd {

namespace {
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
constexpr auto kSpin = std::chrono::microseconds(20);  // the S-Part shares these cores: spin little
}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  for (int t = 1; t < num_threads; ++t) threads_.emplace_back([this, t] { worker(t); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    gen_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

int ThreadPool::default_threads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set) > 0 ? CPU_COUNT(&set) : 1;
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

void ThreadPool::run(const std::function<void(int)>& fn) {
  if (threads_.empty()) {
    fn(0);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = &fn;
    pending_.store(static_cast<int>(threads_.size()), std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  fn(0);
  const auto start = std::chrono::steady_clock::now();
  while (pending_.load(std::memory_order_acquire) != 0) {
    cpu_relax();
    if (std::chrono::steady_clock::now() - start > kSpin) std::this_thread::yield();
  }
}

void ThreadPool::worker(int tid) {
  uint64_t seen = 0;
  for (;;) {
    // Spin a little for the next job, then sleep.
    const auto start = std::chrono::steady_clock::now();
    while (gen_.load(std::memory_order_acquire) == seen &&
           std::chrono::steady_clock::now() - start < kSpin)
      cpu_relax();
    const std::function<void(int)>* fn;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return gen_.load(std::memory_order_relaxed) != seen; });
      seen = gen_.load(std::memory_order_relaxed);
      if (stop_) return;
      fn = fn_;
    }
    (*fn)(tid);
    pending_.fetch_sub(1, std::memory_order_release);
  }
}

}  // namespace fd
