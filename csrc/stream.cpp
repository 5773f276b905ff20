// STREAM-style read bandwidth of this machine, measured the way the kernel
// reads: a buffer from mmap + MADV_HUGEPAGE, split statically over N threads,
// each streaming its part with the widest vector loads the CPU has.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "stream.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// GCC 12 warns about _mm512_undefined_epi32() inside its own intrinsics.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace fd {

namespace {

uint64_t read_scalar(const uint64_t* p, size_t n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  for (size_t i = 0; i + 4 <= n; i += 4) {
    a ^= p[i];
    b ^= p[i + 1];
    c ^= p[i + 2];
    d ^= p[i + 3];
  }
  return a ^ b ^ c ^ d;
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) uint64_t read_avx512(const uint64_t* p, size_t n) {
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  const __m512i* v = reinterpret_cast<const __m512i*>(p);
  for (size_t i = 0; i + 4 <= n / 8; i += 4) {
    a = _mm512_xor_si512(a, _mm512_load_si512(v + i));
    b = _mm512_xor_si512(b, _mm512_load_si512(v + i + 1));
    c = _mm512_xor_si512(c, _mm512_load_si512(v + i + 2));
    d = _mm512_xor_si512(d, _mm512_load_si512(v + i + 3));
  }
  a = _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d));
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(a));
}

__attribute__((target("avx2"))) uint64_t read_avx2(const uint64_t* p, size_t n) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  const __m256i* v = reinterpret_cast<const __m256i*>(p);
  for (size_t i = 0; i + 4 <= n / 4; i += 4) {
    a = _mm256_xor_si256(a, _mm256_load_si256(v + i));
    b = _mm256_xor_si256(b, _mm256_load_si256(v + i + 1));
    c = _mm256_xor_si256(c, _mm256_load_si256(v + i + 2));
    d = _mm256_xor_si256(d, _mm256_load_si256(v + i + 3));
  }
  a = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
  alignas(32) uint64_t out[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(out), a);
  return out[0] ^ out[1] ^ out[2] ^ out[3];
}
#endif

}  // namespace

StreamBuffer::StreamBuffer(size_t bytes, bool hugepages) {
  constexpr size_t kHuge = size_t(2) << 20;
  bytes_ = std::max(kHuge, bytes / kHuge * kHuge);
  map_bytes_ = bytes_ + kHuge;
  mem_ = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem_ == MAP_FAILED) throw ValueErr("cannot map the bandwidth buffer");
  buf_ = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(mem_) + kHuge - 1) & ~(kHuge - 1));
#ifdef MADV_HUGEPAGE
  if (hugepages) madvise(buf_, bytes_, MADV_HUGEPAGE);
#endif
  std::memset(buf_, 1, bytes_);
}

StreamBuffer::~StreamBuffer() { munmap(mem_, map_bytes_); }

double StreamBuffer::read(int threads) {
  uint64_t (*fn)(const uint64_t*, size_t) = read_scalar;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f"))
    fn = read_avx512;
  else if (__builtin_cpu_supports("avx2"))
    fn = read_avx2;
#endif
  const size_t words = bytes_ / 8, per = words / threads / 64 * 64;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load()) {
      }
      sink_.fetch_xor(fn(reinterpret_cast<const uint64_t*>(buf_) + t * per, per));
    });
  while (ready.load() < threads) {
  }
  const auto t0 = std::chrono::steady_clock::now();
  go.store(true);
  for (auto& t : ts) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(per * threads * 8) / s / 1e9;
}

}  // namespace fd
