#include "page_populator.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace fd {

namespace {
constexpr size_t kChunk = size_t{32} << 20;  // bytes a madvise call populates: how long a stop waits at most
constexpr size_t kAlign = size_t{2} << 20;   // requests are rounded up to whole huge pages
}  // namespace

PagePopulator::PagePopulator(uint8_t* base, size_t bytes) : base_(base), bytes_((bytes + kAlign - 1) / kAlign * kAlign) {
  thread_ = std::thread([this] { run(); });
}

PagePopulator::~PagePopulator() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

void PagePopulator::reach(size_t bytes) {
  bytes = std::min((bytes + kAlign - 1) / kAlign * kAlign, bytes_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (bytes <= target_) return;
    target_ = bytes;
  }
  cv_.notify_one();
}

void PagePopulator::run() {
  size_t done = 0;
  for (;;) {
    size_t end;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || target_ > done; });
      if (stop_) return;
      end = std::min(target_, done + kChunk);
    }
    if (madvise(base_ + done, end - done, MADV_POPULATE_WRITE) != 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return;  // EINVAL: a kernel without it; ENOMEM, EFAULT: no memory for it (the appends fault as before)
    }
    done = end;
    done_.store(done, std::memory_order_relaxed);
  }
}

}  // namespace fd
