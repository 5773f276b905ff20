// Commits the pages of the KV pool ahead of their first use, on a thread of its own.
//
// A page's first write otherwise happens inside an append, on one of the kernel's threads, while
// the others wait for it at the end of the call: on VMs whose host backs guest memory lazily a
// first write costs 2-3 ms per 2 MB page, and a batch of 512 that starts a new block in every
// layer needs about 90 of them in one step. reach(n) asks for the first n bytes of the region;
// the thread populates them in chunks (MADV_POPULATE_WRITE, Linux 5.14+, which faults the pages
// in without writing to them, so it may overlap the kernel's own writes). Where the kernel lacks
// it, nothing is populated and pages fault on first use as before.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>

namespace fd {

class PagePopulator {
 public:
  PagePopulator(uint8_t* base, size_t bytes);
  ~PagePopulator();  // stops after the chunk in flight and joins
  PagePopulator(const PagePopulator&) = delete;
  PagePopulator& operator=(const PagePopulator&) = delete;

  void reach(size_t bytes);  // populate [0, min(bytes, size)) if not yet; returns at once
  size_t populated() const { return done_.load(std::memory_order_relaxed); }

 private:
  void run();

  uint8_t* base_;
  size_t bytes_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t target_ = 0;  // under mu_
  bool stop_ = false;  // under mu_
  std::atomic<size_t> done_{0};
  std::thread thread_;
};

}  // namespace fd
