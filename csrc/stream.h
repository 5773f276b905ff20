// STREAM-style read bandwidth of this machine, measured the way the kernel
// reads: a buffer from mmap + MADV_HUGEPAGE (like the KV pool), split
// statically over N threads, each streaming its part with the widest vector
// loads the CPU has. The benchmark interleaves read() with kernel calls.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "common.h"

namespace fd {

class StreamBuffer {
 public:
  StreamBuffer(size_t bytes, bool hugepages);
  ~StreamBuffer();
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;

  double read(int threads);  // GB/s of one pass over the buffer
  size_t bytes() const { return bytes_; }

 private:
  void* mem_ = nullptr;
  uint8_t* buf_ = nullptr;
  size_t bytes_ = 0, map_bytes_ = 0;
  std::atomic<uint64_t> sink_{0};  // keeps the reads alive
};

}  // namespace fd
