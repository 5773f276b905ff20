// bfloat16 <-> float32 bits for the S-Part's C++ ops.
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

}  // namespace fd_spart
