// Fused ops of the S-Part on the CPU (fastdecode._spart_ops), bf16 or fp32, one pass over
// memory each where torch runs 3-8 ops. Each computes what the torch code in
// fastdecode/model/layers.py computes, rounding to bf16 where torch does in bf16, so results
// match it but for float32 summation order and exp's last bits. One template body per op,
// instantiated for both element types (Bf16 and F32 below) inside target_clones wrappers.
// Threads: torch's own OpenMP team (at::parallel_for); vector code per ISA by target_clones.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <limits>

#include "bf16.h"
#include "bf16_avx512.h"
#include "gemm_bf16.h"
#include "gemv_bf16.h"
#include "packed_gemm.h"

namespace {

#define FD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

constexpr int64_t kGrainElems = 1 << 14;   // elements a thread gets at least: below, one thread is faster

using fd_spart::bf2f;
using fd_spart::f2bf;

inline float round_bf(float f) { return bf2f(f2bf(f)); }

// exp for the vector loops (Cephes' polynomial on a range-reduced argument; about 1 ulp in
// float32, far below bf16's rounding). Clamped: exp(-87) is already below bf16's smallest normal.
inline float fast_exp(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.7f ? 88.7f : x;
  constexpr float kRound = 12582912.f;                  // 1.5 * 2^23: adding it rounds to an integer
  const float shifted = x * 1.44269504088896341f + kRound;   // that integer n in the low mantissa bits
  const float n = shifted - kRound;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = __builtin_bit_cast(int32_t, shifted) - __builtin_bit_cast(int32_t, kRound);
  return p * __builtin_bit_cast(float, (e + 127) << 23);
}

// Element types: E::ld to float, E::st from float (rounded), E::rnd = the rounding torch applies
// to an intermediate result of this dtype.
struct Bf16 {
  using T = uint16_t;
  static float ld(T b) { return bf2f(b); }
  static T st(float f) { return f2bf(f); }
  static float rnd(float f) { return round_bf(f); }
  static const T* ptr(const at::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr<at::BFloat16>()); }
  static T* mut(at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr<at::BFloat16>()); }
};
struct F32 {
  using T = float;
  static float ld(T f) { return f; }
  static T st(float f) { return f; }
  static float rnd(float f) { return f; }
  static const T* ptr(const at::Tensor& t) { return t.data_ptr<float>(); }
  static T* mut(at::Tensor& t) { return t.data_ptr<float>(); }
};
#define FD_INLINE __attribute__((always_inline)) inline

const uint16_t* bf(const at::Tensor& t) { return Bf16::ptr(t); }
uint16_t* bf_mut(at::Tensor& t) { return Bf16::mut(t); }

bool is_fused_dtype(at::ScalarType t) { return t == at::kBFloat16 || t == at::kFloat; }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(is_fused_dtype(x.scalar_type()), name, " must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, name, " must be [rows, hidden], got ", x.sizes());
  TORCH_CHECK(x.stride(1) == 1, name, " must have contiguous rows");
}

int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(row_elems, 1)); }

// y = w * rnd(x * rsqrt(mean(x^2) + eps)), x first replaced by rnd(x + d) when d is given.
template <class E>
FD_INLINE void norm_row_t(typename E::T* x, const typename E::T* d, const typename E::T* w, typename E::T* y,
                          int64_t n, float eps) {
  float ss = 0.f;
  if (d != nullptr) {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) {
      const typename E::T s = E::st(E::ld(x[i]) + E::ld(d[i]));
      x[i] = s;
      const float f = E::ld(s);
      ss += f * f;
    }
  } else {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) {
      const float f = E::ld(x[i]);
      ss += f * f;
    }
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = E::st(E::ld(w[i]) * E::rnd(E::ld(x[i]) * inv));
}
FD_CLONES void norm_row(uint16_t* x, const uint16_t* d, const uint16_t* w, uint16_t* y, int64_t n, float eps) {
  norm_row_t<Bf16>(x, d, w, y, n, eps);
}
FD_CLONES void norm_row(float* x, const float* d, const float* w, float* y, int64_t n, float eps) {
  norm_row_t<F32>(x, d, w, y, n, eps);
}

template <class E>
void norm_rows(at::Tensor& x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, at::Tensor& y,
               double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  auto* xp = E::mut(x);
  const auto* dp = delta ? E::ptr(*delta) : nullptr;
  const auto* wp = E::ptr(weight);
  auto* yp = E::mut(y);
  const int64_t xs = x.stride(0), ds = delta ? delta->stride(0) : 0;
  at::parallel_for(0, rows, row_grain(n), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r)
      norm_row(xp + r * xs, dp ? dp + r * ds : nullptr, wp, yp + r * n, n, static_cast<float>(eps));
  });
}

at::Tensor norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.is_contiguous() &&
                  weight.size(0) == x.size(1),
              "weight must be a contiguous ", x.scalar_type(), " [", x.size(1), "]");
  if (delta) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(),
                "delta must be shaped and typed as x, got ", delta->sizes(), " and ", x.sizes());
  }
  at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    norm_rows<Bf16>(x, delta, weight, y, eps);
  else
    norm_rows<F32>(x, delta, weight, y, eps);
  return y;
}

// rms_norm(x, w, eps) -> y.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor h = x;   // not written: no delta
  return norm(h, c10::nullopt, weight, eps);
}

// add_rms_norm(h, d, w, eps) -> y; h += d in place (rounded to bf16, as h + d is).
at::Tensor add_rms_norm(at::Tensor h, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return norm(h, delta, weight, eps);
}

// x[t, h, :] = x * cos[t] + rotate_half(x) * sin[t], each product and the sum rounded as torch does.
template <class E>
FD_INLINE void rope_head_t(typename E::T* x, const typename E::T* c, const typename E::T* s, int64_t half) {
  alignas(64) typename E::T lo[256];
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) lo[i] = x[i];
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = E::ld(x[i]), b = E::ld(x[i + half]);
    x[i] = E::st(E::rnd(a * E::ld(c[i])) + E::rnd(-b * E::ld(s[i])));
  }
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = E::ld(lo[i]), b = E::ld(x[i + half]);
    x[i + half] = E::st(E::rnd(b * E::ld(c[i + half])) + E::rnd(a * E::ld(s[i + half])));
  }
}
FD_CLONES void rope_head(uint16_t* x, const uint16_t* c, const uint16_t* s, int64_t half) {
  rope_head_t<Bf16>(x, c, s, half);
}
FD_CLONES void rope_head(float* x, const float* c, const float* s, int64_t half) { rope_head_t<F32>(x, c, s, half); }

template <class E>
void rope_rows(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  auto* xp = E::mut(x);
  const auto *cp = E::ptr(cos), *sp = E::ptr(sin);
  const int64_t xs = x.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, T, row_grain(H * D), [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t)
      for (int64_t h = 0; h < H; ++h) rope_head(xp + t * xs + h * D, cp + t * cs, sp + t * ss, D / 2);
  });
}

// x [T, heads, D] (rows may be strided, heads and D contiguous), cos, sin [T, D] of x's dtype.
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && is_fused_dtype(x.scalar_type()) && x.dim() == 3,
              "x must be a CPU bfloat16 or float32 [T, heads, D]");
  const int64_t T = x.size(0), D = x.size(2);
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == D, "x must have contiguous heads");
  TORCH_CHECK(D % 2 == 0 && D <= 512, "head_dim must be even and <= 512, got ", D);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->dim() == 2 && t->size(0) == T && t->size(1) == D &&
                    t->stride(1) == 1,
                "cos and sin must be ", x.scalar_type(), " [", T, ", ", D, "] with contiguous rows");
  if (x.scalar_type() == at::kBFloat16)
    rope_rows<Bf16>(x, cos, sin);
  else
    rope_rows<F32>(x, cos, sin);
}

// out = rnd(silu(gate)) * up, rounded: gate, up = the two halves of each row of gu.
template <class E>
FD_INLINE void silu_mul_row_t(const typename E::T* __restrict g, const typename E::T* __restrict u,
                              typename E::T* __restrict o, int64_t n) {
  constexpr int64_t kChunk = 64;
  float a[kChunk];
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t m = std::min(kChunk, n - i0);
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) a[i] = E::ld(g[i0 + i]);
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) a[i] = a[i] / (1.f + fast_exp(-a[i]));
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) o[i0 + i] = E::st(E::rnd(a[i]) * E::ld(u[i0 + i]));
  }
}
FD_CLONES void silu_mul_row(const uint16_t* __restrict g, const uint16_t* __restrict u, uint16_t* __restrict o,
                            int64_t n) {
  silu_mul_row_t<Bf16>(g, u, o, n);
}
FD_CLONES void silu_mul_row(const float* __restrict g, const float* __restrict u, float* __restrict o, int64_t n) {
  silu_mul_row_t<F32>(g, u, o, n);
}

// silu_mul_row in AVX-512F, 16 a vector: the same exp, division and roundings, so the same bits.
// (GCC 12 warns about _mm512_undefined_*() inside its own intrinsics.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
using fd_spart::load_bf16x16;
using fd_spart::silu_mul16;

FD_AVX512F_FMA void silu_mul_row_avx512(const uint16_t* __restrict g, const uint16_t* __restrict u,
                                        uint16_t* __restrict o, int64_t n) {
  const int64_t body = n - n % 16;
  for (int64_t i = 0; i < body; i += 16) {
    const __m512i y = silu_mul16(load_bf16x16(g + i), load_bf16x16(u + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(y, 16)));
  }
  if (body < n) silu_mul_row(g + body, u + body, o + body, n - body);
}
#pragma GCC diagnostic pop

const bool kHasAvx512f = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");

at::Tensor silu_mul(const at::Tensor& gu, bool portable) {
  check_rows(gu, "gate_up");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gate_up must have an even number of columns");
  const int64_t rows = gu.size(0), n = gu.size(1) / 2, s = gu.stride(0);
  at::Tensor out = at::empty({rows, n}, gu.options());
  if (gu.scalar_type() == at::kFloat) {
    const float* g = gu.data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, rows, row_grain(2 * n), [&](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) silu_mul_row(g + r * s, g + r * s + n, o + r * n, n);
    });
    return out;
  }
  const uint16_t* g = bf(gu);
  uint16_t* o = bf_mut(out);
  using Row = void (*)(const uint16_t*, const uint16_t*, uint16_t*, int64_t);
  const Row row = kHasAvx512f && !portable ? static_cast<Row>(silu_mul_row_avx512) : static_cast<Row>(silu_mul_row);
  at::parallel_for(0, rows, row_grain(2 * n), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) row(g + r * s, g + r * s + n, o + r * n, n);
  });
  return out;
}

// Index of the first maximum of each row (a NaN counts as the maximum, as in torch.max).
// Keys whose integer order is the float order, NaN above +inf and -0 equal to +0.
inline int32_t argmax_key(uint16_t b) {      // bf16 bits
  const int32_t v = b & 0x7fff;
  if (v > 0x7f80) return 0x10000;
  return (b & 0x8000) ? -v : v;
}
inline int32_t argmax_key(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  const int32_t v = static_cast<int32_t>(u & 0x7fffffffu);
  if (v > 0x7f800000) return std::numeric_limits<int32_t>::max();
  return (u >> 31) ? -v : v;
}

template <typename T, int64_t kLanes>
FD_INLINE int64_t argmax_row_t(const T* x, int64_t n) {
  int32_t best[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) best[l] = std::numeric_limits<int32_t>::min();
  const int64_t body = n - n % kLanes;
  for (int64_t i = 0; i < body; i += kLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) best[l] = std::max(best[l], argmax_key(x[i + l]));
  }
  int32_t m = std::numeric_limits<int32_t>::min();
  for (int64_t l = 0; l < kLanes; ++l) m = std::max(m, best[l]);
  for (int64_t i = body; i < n; ++i) m = std::max(m, argmax_key(x[i]));
  for (int64_t i = 0; i < n; ++i)
    if (argmax_key(x[i]) == m) return i;
  return 0;
}
FD_CLONES int64_t argmax_row(const uint16_t* x, int64_t n) { return argmax_row_t<uint16_t, 32>(x, n); }
FD_CLONES int64_t argmax_row(const float* x, int64_t n) { return argmax_row_t<float, 16>(x, n); }

// argmax_row with AVX-512BW, 32 bf16 a vector: the same keys in 16 bits (NaN as 0x7fff, above +inf's
// 0x7f80); one pass for the maximum, then the first lane equal to it (the row is in cache by then).
#define FD_AVX512BW __attribute__((target("avx512f,avx512bw")))
FD_AVX512BW inline __m512i argmax_keys(__m512i b) {
  const __m512i mag = _mm512_set1_epi16(0x7fff), zero = _mm512_setzero_si512();
  const __m512i v = _mm512_and_si512(b, mag);
  const __mmask32 neg = _mm512_cmplt_epi16_mask(b, zero), nan = _mm512_cmpgt_epi16_mask(v, _mm512_set1_epi16(0x7f80));
  return _mm512_mask_mov_epi16(_mm512_mask_sub_epi16(v, neg, zero, v), nan, mag);
}

FD_AVX512BW int64_t argmax_row_avx512(const uint16_t* x, int64_t n) {
  const __m512i neg_inf = _mm512_set1_epi16(static_cast<int16_t>(0xff80));   // what masked-off lanes read
  const int64_t body = n - n % 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (n % 32)) - 1);
  __m512i best = _mm512_set1_epi16(std::numeric_limits<int16_t>::min());
  for (int64_t i = 0; i < body; i += 32) best = _mm512_max_epi16(best, argmax_keys(_mm512_loadu_si512(x + i)));
  if (tail) best = _mm512_max_epi16(best, argmax_keys(_mm512_mask_loadu_epi16(neg_inf, tail, x + body)));
  alignas(64) int16_t lanes[32];
  _mm512_store_si512(lanes, best);
  int16_t m = lanes[0];
  for (int l = 1; l < 32; ++l) m = std::max(m, lanes[l]);
  const __m512i mv = _mm512_set1_epi16(m);
  for (int64_t i = 0; i < body; i += 32) {
    const __mmask32 hit = _mm512_cmpeq_epi16_mask(argmax_keys(_mm512_loadu_si512(x + i)), mv);
    if (hit) return i + __builtin_ctz(hit);
  }
  const __mmask32 hit = _mm512_cmpeq_epi16_mask(argmax_keys(_mm512_mask_loadu_epi16(neg_inf, tail, x + body)), mv) & tail;
  return hit ? body + __builtin_ctz(hit) : 0;
}

const bool kHasAvx512bw = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");

at::Tensor argmax_rows(const at::Tensor& logits, bool portable) {
  check_rows(logits, "logits");
  const int64_t rows = logits.size(0), n = logits.size(1), s = logits.stride(0);
  TORCH_CHECK(n > 0, "logits must have at least one column");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  if (logits.scalar_type() == at::kFloat) {
    const float* x = logits.data_ptr<float>();
    at::parallel_for(0, rows, 1, [&](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) o[r] = argmax_row(x + r * s, n);
    });
    return out;
  }
  const uint16_t* x = bf(logits);
  const bool vector = kHasAvx512bw && !portable;
  at::parallel_for(0, rows, 1, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) o[r] = vector ? argmax_row_avx512(x + r * s, n) : argmax_row(x + r * s, n);
  });
  return out;
}

// Multinomial sampling of softmax(x / temperature) by inversion: the first token whose
// cumulative weight exceeds u * total. Weights exp((x - max) / T) are summed chunk by chunk in
// the same order in both passes, so the chunk holding the target is always found.
template <class E>
FD_INLINE float chunk_weights_t(const typename E::T* x, int64_t m, float mx, float inv_t, float* w) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < m; ++i) {
    const float v = E::ld(x[i]);
    w[i] = v == -std::numeric_limits<float>::infinity() ? 0.f : fast_exp((v - mx) * inv_t);
    sum += w[i];
  }
  return sum;
}

FD_CLONES float chunk_weights(const uint16_t* x, int64_t m, float mx, float inv_t, float* w) {
  return chunk_weights_t<Bf16>(x, m, mx, inv_t, w);
}
FD_CLONES float chunk_weights(const float* x, int64_t m, float mx, float inv_t, float* w) {
  return chunk_weights_t<F32>(x, m, mx, inv_t, w);
}

template <class E>
FD_INLINE float row_max_t(const typename E::T* x, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, E::ld(x[i]));
  return mx;
}
FD_CLONES float row_max(const uint16_t* x, int64_t n) { return row_max_t<Bf16>(x, n); }
FD_CLONES float row_max(const float* x, int64_t n) { return row_max_t<F32>(x, n); }

template <typename T>
int64_t sample_row(const T* x, int64_t n, float temperature, float u) {
  constexpr int64_t kChunk = 256;
  alignas(64) float w[kChunk];
  const float mx = row_max(x, n), inv_t = 1.f / temperature;
  float total = 0.f;
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) total += chunk_weights(x + i0, std::min(kChunk, n - i0), mx, inv_t, w);
  const float target = u * total;
  float acc = 0.f;
  int64_t last = 0;
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t m = std::min(kChunk, n - i0);
    const float sum = chunk_weights(x + i0, m, mx, inv_t, w);
    if (acc + sum > target) {
      float a = acc;
      for (int64_t i = 0; i < m; ++i) {
        if (w[i] > 0.f) last = i0 + i;
        a += w[i];
        if (a > target && w[i] > 0.f) return i0 + i;
      }
      return last;      // the sum in another order came out a hair larger
    }
    for (int64_t i = m - 1; i >= 0; --i)
      if (w[i] > 0.f) {
        last = i0 + i;
        break;
      }
    acc += sum;
  }
  return last;
}

// rows[j] of logits [B, V] sampled at temperatures[j] with uniform draws u[j] in [0, 1).
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& temperatures,
                       const at::Tensor& u) {
  check_rows(logits, "logits");
  const int64_t R = rows.numel(), B = logits.size(0), n = logits.size(1), s = logits.stride(0);
  TORCH_CHECK(n > 0, "logits must have at least one column");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(), "rows must be int64 [R]");
  for (const at::Tensor* t : {&temperatures, &u})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->numel() == R && t->is_contiguous(),
                "temperatures and u must be float32 [", R, "]");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const float *tp = temperatures.data_ptr<float>(), *up = u.data_ptr<float>();
  for (int64_t j = 0; j < R; ++j) {
    TORCH_CHECK(rp[j] >= 0 && rp[j] < B, "row ", rp[j], " out of range [0, ", B, ")");
    TORCH_CHECK(tp[j] > 0.f && std::isfinite(tp[j]), "temperatures must be finite and > 0");
    TORCH_CHECK(up[j] >= 0.f && up[j] < 1.f, "u must be in [0, 1)");
  }
  at::Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  auto sample = [&](const auto* x) {
    at::parallel_for(0, R, 1, [&](int64_t a, int64_t b) {
      for (int64_t j = a; j < b; ++j) o[j] = sample_row(x + rp[j] * s, n, tp[j], up[j]);
    });
  };
  if (logits.scalar_type() == at::kFloat)
    sample(logits.data_ptr<float>());
  else
    sample(bf(logits));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fused bf16 and fp32 S-Part ops on the CPU (see fastdecode/model/fused.py)";
  m.def("rms_norm", &rms_norm, "rms_norm(x, weight, eps) -> y", py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "add_rms_norm(h, delta, weight, eps) -> y; h += delta in place",
        py::arg("h"), py::arg("delta"), py::arg("weight"), py::arg("eps"));
  m.def("rope_", &rope_, "rope_(x, cos, sin): rotate x [T, heads, D] in place", py::arg("x"), py::arg("cos"),
        py::arg("sin"));
  m.def("silu_mul", &silu_mul,
        "silu_mul(gate_up, portable=False) -> silu(gate) * up (portable: the loop every CPU runs, not the "
        "AVX-512 one where the CPU has it)",
        py::arg("gate_up"), py::arg("portable") = false);
  m.def("argmax_rows", &argmax_rows,
        "argmax_rows(logits, portable=False) -> int64 index of each row's first maximum (portable: the "
        "loop every CPU runs, not the AVX-512 one where the CPU has it)",
        py::arg("logits"), py::arg("portable") = false);
  m.def("sample_rows", &sample_rows,
        "sample_rows(logits, rows, temperatures, u) -> int64 token of each row: softmax(x / T) inverted at u",
        py::arg("logits"), py::arg("rows"), py::arg("temperatures"), py::arg("u"));
  register_packed_gemm(m);
  register_gemm_bf16(m);
  register_gemv_bf16(m);
}
