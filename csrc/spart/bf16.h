// bfloat16 <-> float32 bits, and whether the CPU has AVX512-BF16, for the S-Part's C++ ops.
#pragma once

#include <cstdint>

namespace fd_spart {

inline float bf2f(uint16_t b) { return __builtin_bit_cast(float, static_cast<uint32_t>(b) << 16); }

// Round to nearest even, as c10::BFloat16 does (NaN stays a quiet NaN).
inline uint16_t f2bf(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

// AVX512-BF16 dot products (and the AVX-512 they build on): gemm_bf16 and gemv_bf16 run.
inline bool cpu_has_avx512_bf16() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

}  // namespace fd_spart
