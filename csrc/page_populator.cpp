#include "page_populator.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <fstream>
#include <limits>
#include <string>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace fd {

namespace {
constexpr size_t kChunk = size_t{32} << 20;  // bytes a madvise call populates: how long a stop waits at most
constexpr size_t kAlign = size_t{2} << 20;   // requests are rounded up to whole huge pages
constexpr size_t kReserve = size_t{1} << 30;  // memory left to everything else: populating stops short of it
constexpr size_t kUnknown = std::numeric_limits<size_t>::max();

size_t read_number(const std::string& path) {
  std::ifstream f(path);
  std::string word;
  if (!(f >> word) || word == "max") return kUnknown;
  try {
    return static_cast<size_t>(std::stoull(word));
  } catch (...) {
    return kUnknown;
  }
}

// Bytes this process may still take: MemAvailable, and room under its memory cgroup's limit (v2 or v1).
size_t available_bytes() {
  size_t avail = kUnknown;
  {
    std::ifstream f("/proc/meminfo");
    std::string key;
    size_t kb;
    std::string unit;
    while (f >> key >> kb) {
      std::getline(f, unit);
      if (key == "MemAvailable:") {
        avail = kb * 1024;
        break;
      }
    }
  }
  std::ifstream cg("/proc/self/cgroup");
  std::string line;
  while (std::getline(cg, line)) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string ctl = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    size_t limit = kUnknown, used = kUnknown;
    if (ctl.empty()) {
      limit = read_number("/sys/fs/cgroup" + path + "/memory.max");
      used = read_number("/sys/fs/cgroup" + path + "/memory.current");
    } else if (ctl.find("memory") != std::string::npos) {
      limit = read_number("/sys/fs/cgroup/memory" + path + "/memory.limit_in_bytes");
      used = read_number("/sys/fs/cgroup/memory" + path + "/memory.usage_in_bytes");
    }
    if (limit != kUnknown && used != kUnknown) avail = std::min(avail, limit > used ? limit - used : 0);
  }
  return avail;
}
}  // namespace

PagePopulator::PagePopulator(uint8_t* base, size_t bytes) : base_(base), bytes_((bytes + kAlign - 1) / kAlign * kAlign) {
  thread_ = std::thread([this] {
    run();
    std::lock_guard<std::mutex> lk(mu_);
    finished_ = true;
    cv_.notify_all();
  });
}

PagePopulator::~PagePopulator() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  thread_.join();
}

bool PagePopulator::wait(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return finished_; });
}

void PagePopulator::run() {
  size_t done = 0;
  while (done < bytes_) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_) return;
    }
    const size_t end = std::min(bytes_, done + kChunk);
    const size_t avail = available_bytes();
    if (avail != kUnknown && avail < (end - done) + kReserve) return;  // the rest faults in on first use
    if (madvise(base_ + done, end - done, MADV_POPULATE_WRITE) != 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return;  // EINVAL: a kernel without it; ENOMEM, EFAULT: no memory for it (the appends fault as before)
    }
    done = end;
    done_.store(done, std::memory_order_relaxed);
  }
}

}  // namespace fd
