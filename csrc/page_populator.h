// Commits the pages of the KV pool before their first use, on a thread of its own.
//
// A page's first write otherwise happens inside an append, on one of the kernel's threads, while
// the others wait for it at the end of the call: on VMs whose host backs guest memory lazily a
// first write costs 2-6 ms per 2 MB page, and a batch of 512 that starts a new block in every
// layer needs about 90 of them in one step. The thread populates the region front to back in
// chunks (MADV_POPULATE_WRITE, Linux 5.14+, which faults the pages in without writing to them, so
// it may overlap the store's own writes). Where the kernel lacks it, nothing is populated and
// pages fault on first use as before. It stops where the machine (or the process's memory cgroup)
// would be left with less than 1 GiB: a pool larger than the memory there is then still only
// taken as it is used.
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
  PagePopulator(uint8_t* base, size_t bytes);  // starts at once
  ~PagePopulator();                             // stops after the chunk in flight and joins
  PagePopulator(const PagePopulator&) = delete;
  PagePopulator& operator=(const PagePopulator&) = delete;

  bool wait(double timeout_s);  // until it has finished (all of it, or where it stopped); false on timeout
  size_t populated() const { return done_.load(std::memory_order_relaxed); }

 private:
  void run();

  uint8_t* base_;
  size_t bytes_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;      // under mu_
  bool finished_ = false;  // under mu_
  std::atomic<size_t> done_{0};
  std::thread thread_;
};

}  // namespace fd
