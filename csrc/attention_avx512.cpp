// AVX-512 paths, W = 16 lanes (fp16 converted with vcvtph2ps):
//   avx512      F + BW + VL + DQ, all math in fp32;
//   avx512vnni  the same, with int4 key scores as integer dot products (AVX512-VNNI).
#include "common.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC 12 warns about _mm512_undefined_ps() inside its own intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace fd {
namespace avx512_isa {

struct V {
  static constexpr int W = 16, kRegs = 32;
  typedef __m512 F;
  static inline F zero() { return _mm512_setzero_ps(); }
  static inline F set1(float x) { return _mm512_set1_ps(x); }
  static inline F load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static inline F load_h(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
  static inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static inline F max(F a, F b) { return _mm512_max_ps(a, b); }
  static inline float hmax(F x) { return _mm512_reduce_max_ps(x); }
  static inline float hsum(F x) { return _mm512_reduce_add_ps(x); }
  static inline float first(F x) { return _mm512_cvtss_f32(x); }
  // 2^x for x <= 0: scalef(poly(frac), round(x)), 0 below -126 (covers -inf).
  static inline F exp2(F x) {
    const F lim = _mm512_set1_ps(-126.0f);
    const __mmask16 live = _mm512_cmp_ps_mask(x, lim, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lim);
    const F n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const F f = _mm512_sub_ps(x, n);
    F p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
  }
  static inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T2); }
  typedef __m512i I;
  static inline I load_u32(const uint32_t* p) { return _mm512_loadu_si512(p); }
  template <int S>
  static inline F nib_at(I x) {  // (x >> S) & 15 per lane, as float (vpermps reads 4 index bits)
    const F lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_permutexvar_ps(S ? _mm512_srli_epi32(x, S) : x, lut);
  }
};

#include "attention_impl.h"

}  // namespace avx512_isa
}  // namespace fd

#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

namespace fd {
namespace avx512vnni_isa {

struct V : avx512_isa::V {
  static inline I izero() { return _mm512_setzero_si512(); }
  static inline I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static inline F cvt(I x) { return _mm512_cvtepi32_ps(x); }
  // The low and high nibbles of every byte, as bytes.
  static inline void nib_bytes(I x, I& lo, I& hi) {
    const I m = _mm512_set1_epi8(15);
    lo = _mm512_and_si512(x, m);
    hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m);
  }
  // acc + sum of the 4 byte products u8(u) * s8(w) in each 32-bit lane, w the same for every lane
  // (GCC does not fold the broadcast into the instruction; the asm takes it from memory, {1to16}.)
  static inline I dpbusd(I acc, I u, const int32_t* w) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*w));
    return acc;
  }
  // The same with w in a register (through the intrinsic, GCC 12 copied every accumulator per use).
  static inline I dpbusd(I acc, I u, I w) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(w));
    return acc;
  }
  static inline I iset1(int32_t x) { return _mm512_set1_epi32(x); }
};

#define FD_VNNI 1
#include "attention_impl.h"
#undef FD_VNNI

}  // namespace avx512vnni_isa
}  // namespace fd

#pragma GCC pop_options

namespace fd {
ItemsFn avx512_items() { return &avx512_isa::run_items; }
ItemsFn avx512vnni_items() { return &avx512vnni_isa::run_items; }
}  // namespace fd

#else
namespace fd {
ItemsFn avx512_items() { return nullptr; }
ItemsFn avx512vnni_items() { return nullptr; }
}  // namespace fd
#endif
