// y = x @ weight.T for one row x, bf16 in and out, float32 sums: the S-Part's products at a batch of
// one, where they only stream the weights. oneDNN's packed product read them at about half of the
// machine's bandwidth there; this reads each weight row once, four rows at a time, with AVX512-BF16
// dot products (the same pairwise bf16 products in float32 that oneDNN's kernels take, so results
// differ from F.linear only by summation order: within one bf16 rounding). Only where the CPU has
// AVX512-BF16; elsewhere PackedLinear keeps oneDNN. Reference: F.linear (tests/test_gemv_bf16.py).
#include "gemv_bf16.h"

#include "bf16.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cstdint>

// GCC 12 warns about _mm512_undefined_* inside its own intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace {

constexpr int64_t kRowsPerTask = 4;
constexpr int64_t kGrainRows = 64;   // weight rows a thread gets at least

using fd_spart::f2bf;

#define FD_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

FD_BF16 inline __m512bh load(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
FD_BF16 inline __m512bh load_masked(__mmask32 m, const uint16_t* p) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }

// Rows [n0, n1) of y; K any length (the channels past the last multiple of 32 masked).
FD_BF16 void rows_bf16(const uint16_t* x, const uint16_t* w, int64_t K, int64_t n0, int64_t n1, uint16_t* y) {
  const int64_t full = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (K - full)) - 1);
  int64_t n = n0;
  for (; n + kRowsPerTask <= n1; n += kRowsPerTask) {
    const uint16_t* r = w + n * K;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < full; k += 32) {
      const __m512bh xv = load(x + k);
      a0 = _mm512_dpbf16_ps(a0, xv, load(r + k));
      a1 = _mm512_dpbf16_ps(a1, xv, load(r + K + k));
      a2 = _mm512_dpbf16_ps(a2, xv, load(r + 2 * K + k));
      a3 = _mm512_dpbf16_ps(a3, xv, load(r + 3 * K + k));
    }
    if (tail) {
      const __m512bh xv = load_masked(tail, x + full);
      a0 = _mm512_dpbf16_ps(a0, xv, load_masked(tail, r + full));
      a1 = _mm512_dpbf16_ps(a1, xv, load_masked(tail, r + K + full));
      a2 = _mm512_dpbf16_ps(a2, xv, load_masked(tail, r + 2 * K + full));
      a3 = _mm512_dpbf16_ps(a3, xv, load_masked(tail, r + 3 * K + full));
    }
    y[n] = f2bf(_mm512_reduce_add_ps(a0));
    y[n + 1] = f2bf(_mm512_reduce_add_ps(a1));
    y[n + 2] = f2bf(_mm512_reduce_add_ps(a2));
    y[n + 3] = f2bf(_mm512_reduce_add_ps(a3));
  }
  for (; n < n1; ++n) {
    const uint16_t* r = w + n * K;
    __m512 a = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += 32) a = _mm512_dpbf16_ps(a, load(x + k), load(r + k));
    if (tail) a = _mm512_dpbf16_ps(a, load_masked(tail, x + full), load_masked(tail, r + full));
    y[n] = f2bf(_mm512_reduce_add_ps(a));
  }
}

bool available() { return fd_spart::cpu_has_avx512_bf16(); }

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(available(), "gemv_bf16 needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "x and weight must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "x and weight must be bfloat16");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [N, K] tensor");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.size(1) == weight.size(1) && x.stride(1) == 1,
              "x must be [1, ", weight.size(1), "] with contiguous channels, got ", x.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  at::Tensor y = at::empty({1, N}, x.options());
  if (N == 0) return y;
  if (K == 0) return y.zero_();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t tasks = (N + kRowsPerTask - 1) / kRowsPerTask;
  {
    pybind11::gil_scoped_release release;
    at::parallel_for(0, tasks, kGrainRows / kRowsPerTask, [&](int64_t t0, int64_t t1) {
      rows_bf16(xp, wp, K, t0 * kRowsPerTask, std::min(N, t1 * kRowsPerTask), yp);
    });
  }
  return y;
}

}  // namespace

void register_gemv_bf16(pybind11::module_& m) {
  m.def("gemv_bf16_available", &available, "True where the CPU has AVX512-BF16 (gemv_bf16 runs)");
  m.def("gemv_bf16", &gemv_bf16, "gemv_bf16(x [1, K] bfloat16, weight [N, K] bfloat16) -> x @ weight.T [1, N]",
        py::arg("x"), py::arg("weight"));
}
