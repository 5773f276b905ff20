// Portable path: W = 1 lane, builds and runs on any 64-bit CPU.
#include "common.h"

namespace fd {
namespace scalar_isa {

struct V {
  static constexpr int W = 1, kRegs = 16;
  typedef float F;
  static inline F zero() { return 0.0f; }
  static inline F set1(float x) { return x; }
  static inline F load(const float* p) { return *p; }
  static inline void store(float* p, F x) { *p = x; }
  static inline F load_h(const uint16_t* p) { return h2f(*p); }
  static inline F fma(F a, F b, F c) { return a * b + c; }
  static inline F add(F a, F b) { return a + b; }
  static inline F sub(F a, F b) { return a - b; }
  static inline F mul(F a, F b) { return a * b; }
  static inline F max(F a, F b) { return a > b ? a : b; }
  static inline float hmax(F x) { return x; }
  static inline float hsum(F x) { return x; }
  static inline float first(F x) { return x; }
  static inline F exp2(F x) { return x < -126.0f ? 0.0f : std::exp2(x); }
  static inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 1); }
  typedef uint32_t I;
  static inline I load_u32(const uint32_t* p) { return *p; }
  template <int S>
  static inline F nib_at(I x) { return static_cast<float>((x >> S) & 15u); }
};

#include "attention_impl.h"

}  // namespace scalar_isa

ItemsFn scalar_items() { return &scalar_isa::run_items; }

}  // namespace fd
