#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <omp.h>

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

ThreadPool::ThreadPool(int num_threads, bool openmp) : openmp_(openmp), openmp_threads_(num_threads) {
  if (openmp) return;
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

// The scheduler wakes a thread on the CPU of the thread that woke it when it deems the two to
// share data, and the caller goes on to run its own share: a worker woken there waits for it,
// and the call gets no help (2 threads, SmolLM2 shape at batch 16, two stores in one process: a
// call took 1.36 ms, the worker starting after the caller's share; 0.83 ms with the worker kept
// off). So the workers may run anywhere the caller may, but on its CPU; their masks change only
// when the caller's CPU does.
void ThreadPool::keep_off(int cpu) {
#ifdef __linux__
  if (cpu < 0 || cpu == caller_cpu_) return;
  caller_cpu_ = cpu;
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0 || !CPU_ISSET(cpu, &allowed) || CPU_COUNT(&allowed) < 2)
    return;
  CPU_CLR(cpu, &allowed);
  for (auto& t : threads_) pthread_setaffinity_np(t.native_handle(), sizeof(allowed), &allowed);
#else
  (void)cpu;
#endif
}

void ThreadPool::run(const std::function<void(int)>& fn) {
  if (openmp_ && openmp_threads_ > 1) {
#pragma omp parallel num_threads(openmp_threads_)
    fn(omp_get_thread_num());
    return;
  }
  if (threads_.empty()) {
    fn(0);
    return;
  }
#ifdef __linux__
  keep_off(sched_getcpu());
#endif
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = &fn;
    closed_ = false;
    entered_ = 0;
    done_.store(0, std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  fn(0);
  int entered;
  {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
    entered = entered_;
  }
  const auto start = std::chrono::steady_clock::now();
  while (done_.load(std::memory_order_acquire) != entered) {
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
      if (closed_) continue;
      ++entered_;
      fn = fn_;
    }
    (*fn)(tid);
    done_.fetch_add(1, std::memory_order_release);
  }
}

}  // namespace fd
