// AVX-512F pieces shared by the fused ops (fused_ops.cpp) and the matrix product's fused
// epilogue (gemm_bf16.cpp): bf16 loads, fd_spart::f2bf's rounding and fast_exp, 16 at a time,
// so that both compute the same bits as the scalar code.
#pragma once

#include <immintrin.h>

#include <cstdint>

// GCC 12 warns about _mm512_undefined_*() inside its own intrinsics.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define FD_AVX512F_FMA __attribute__((target("avx512f,fma")))

namespace fd_spart {

FD_AVX512F_FMA inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Round to nearest even as f2bf (NaN -> 0x7fc0), kept as float bits with the low half zero.
FD_AVX512F_FMA inline __m512i round_bf16x16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_mov_epi32(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))), nan,
                               _mm512_set1_epi32(0x7fc00000));
}

FD_AVX512F_FMA inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 k_round = _mm512_set1_ps(12582912.f);
  const __m512 shifted = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), k_round);
  const __m512 n = _mm512_sub_ps(shifted, k_round);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_sub_epi32(_mm512_castps_si512(shifted), _mm512_castps_si512(k_round));
  return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(127)), 23)));
}

// silu(g) rounded, times u, rounded: fused_ops' silu_mul on 16 bf16 pairs given as floats.
FD_AVX512F_FMA inline __m512 silu16(__m512 g) {
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

FD_AVX512F_FMA inline __m512i silu_mul16(__m512 g, __m512 u) {
  return round_bf16x16(_mm512_mul_ps(_mm512_castsi512_ps(round_bf16x16(silu16(g))), u));
}

}  // namespace fd_spart

#pragma GCC diagnostic pop
