// AVX2 + FMA + F16C path (the paper's baseline ISA): W = 8 lanes.
#include "common.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace fd {
namespace avx2_isa {

struct V {
  static constexpr int W = 8, kRegs = 16;
  typedef __m256 F;
  static inline F zero() { return _mm256_setzero_ps(); }
  static inline F set1(float x) { return _mm256_set1_ps(x); }
  static inline F load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static inline F load_h(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
  static inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static inline F max(F a, F b) { return _mm256_max_ps(a, b); }
  static inline float hmax(F x) {
    __m128 v = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    v = _mm_max_ps(v, _mm_movehl_ps(v, v));
    v = _mm_max_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
  }
  static inline float first(F x) { return _mm256_cvtss_f32(x); }
  static inline float hsum(F x) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
  }
  // 2^x for x <= 0: 2^round(x) * poly(frac), 0 below -126 (covers -inf).
  static inline F exp2(F x) {
    const F lim = _mm256_set1_ps(-126.0f);
    const F live = _mm256_cmp_ps(x, lim, _CMP_GE_OQ);
    x = _mm256_max_ps(x, lim);
    const F n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const F f = _mm256_sub_ps(x, n);
    F p = _mm256_set1_ps(1.5403530393381606e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
  }
  static inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T2); }
  typedef __m256i I;
  static inline I load_u32(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  template <int S>
  static inline F nib_at(I x) {  // (x >> S) & 15 per lane, as float
    return _mm256_cvtepi32_ps(_mm256_and_si256(S ? _mm256_srli_epi32(x, S) : x, _mm256_set1_epi32(15)));
  }
};

#include "attention_impl.h"

}  // namespace avx2_isa
}  // namespace fd

#pragma GCC pop_options

namespace fd {
ItemsFn avx2_items() { return &avx2_isa::run_items; }
}  // namespace fd

#else
namespace fd {
ItemsFn avx2_items() { return nullptr; }
}  // namespace fd
#endif
