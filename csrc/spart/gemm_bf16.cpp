// y = x @ weight.T for a batch of rows, bf16 in and out, float32 sums, on a weight packed once: the
// S-Part's products at decode batches on CPUs with AVX512-BF16 but no AMX (Zen 4 and 5, Cooper
// Lake, a Xeon whose AMX is not exposed), where oneDNN's packed bf16 product ran at 80-90% of the
// dot-product peak on the model's short rows (K = 576). The weight is packed in panels of 64 output
// channels, each channel pair-interleaved ([N/64][K/2][64][2]), so that one k-pair of a panel is
// four zmm loads; a tile of 6 rows x 64 channels keeps 24 accumulators in registers, each x pair
// broadcast once per row. Threads split (row chunk, panel) items: a row chunk's panels one after
// another, so that its rows stay in L2, or for a weight larger than a cache a panel's row chunks.
// Sums are the pairwise bf16 products in float32 that oneDNN's kernels take, in another order:
// results differ from F.linear by at most one bf16 rounding. A gate-up weight packed with glu also
// gives fused_ops' silu_mul of its product straight from the registers (the same bits), so that the
// MLP's [M, 2I] intermediate is never written.
// Reference: F.linear (tests/test_gemm_bf16.py).
#include "gemm_bf16.h"

#include "bf16.h"
#include "bf16_avx512.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <atomic>
#include <cstdint>

// GCC 12 warns about _mm512_undefined_* inside its own intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace {

constexpr int64_t kPanel = 64;       // output channels of a panel
constexpr int64_t kTileRows = 6;     // rows of a register tile
constexpr int64_t kChunkRows = 64;   // rows of a work item
constexpr int64_t kStreamedWeightBytes = int64_t{16} << 20;

#define FD_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,fma")))

// What a panel's 64 channels are and where they go. kPlain: channels [64p, 64p + 64) of the
// weight. A gate-up weight [2I, K] (gate rows, then up rows) packed with glu: panel p holds gate
// channels [32p, 32p + 32) and then the same up channels, written to columns 32p and I + 32p
// (kGlu), or multiplied as fused_ops' silu_mul into column 32p of an [M, I] result (kSiluMul).
enum class Layout { kPlain, kGlu, kSiluMul };

FD_BF16 inline void store16(uint16_t* p, __m512i rounded) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// f2bf's round to nearest even by the hardware (vcvtneps2bf16), as float bits: the same bits for
// every normal number, zero and inf; a float32 denormal (under 1.2e-38) becomes zero and a NaN
// stays a NaN (not always 0x7fc0). The silu_mul epilogue rounds four times: this takes about 2%
// off the gate-up product; the plain stores keep round_bf16x16 (1-3% faster there, on Zen 4).
FD_BF16 inline __m512 rounded(__m512 f) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(f)), 16));
}

// fused_ops' silu_mul (the same bits) on 16 pairs of sums, rounded to bf16.
FD_BF16 inline __m256i silu_mul_sums(__m512 gate, __m512 up) {
  return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(rounded(fd_spart::silu16(rounded(gate))), rounded(up)));
}

// Rows [0, R) of x (row stride ldx) times one panel -> y (row stride ldy); up: kGlu's up offset.
template <int R, Layout L>
FD_BF16 void tile(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t pairs, uint16_t* y, int64_t ldy,
                  int64_t up) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint32_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = reinterpret_cast<const uint32_t*>(x + r * ldx);
  const uint16_t* w = panel;
  for (int64_t kk = 0; kk < pairs; ++kk, w += 2 * kPanel) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(w + 64), w3 = (__m512bh)_mm512_loadu_si512(w + 96);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r][kk]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], b, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], b, w3);
    }
  }
  for (int r = 0; r < R; ++r) {
    uint16_t* yr = y + r * ldy;
    if constexpr (L == Layout::kSiluMul) {
      for (int j = 0; j < 2; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr + 16 * j), silu_mul_sums(acc[r][j], acc[r][j + 2]));
    } else {
      const int64_t second = L == Layout::kGlu ? up : 32;
      store16(yr, fd_spart::round_bf16x16(acc[r][0]));
      store16(yr + 16, fd_spart::round_bf16x16(acc[r][1]));
      store16(yr + second, fd_spart::round_bf16x16(acc[r][2]));
      store16(yr + second + 16, fd_spart::round_bf16x16(acc[r][3]));
    }
  }
}

template <Layout L>
FD_BF16 void rows_times_panel(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* panel, int64_t pairs,
                              uint16_t* y, int64_t ldy, int64_t up) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows)
    tile<kTileRows, L>(x + r * ldx, ldx, panel, pairs, y + r * ldy, ldy, up);
  const uint16_t* xs = x + r * ldx;
  uint16_t* ys = y + r * ldy;
  switch (rows - r) {
    case 1: tile<1, L>(xs, ldx, panel, pairs, ys, ldy, up); break;
    case 2: tile<2, L>(xs, ldx, panel, pairs, ys, ldy, up); break;
    case 3: tile<3, L>(xs, ldx, panel, pairs, ys, ldy, up); break;
    case 4: tile<4, L>(xs, ldx, panel, pairs, ys, ldy, up); break;
    case 5: tile<5, L>(xs, ldx, panel, pairs, ys, ldy, up); break;
    default: break;
  }
}

bool available() { return fd_spart::cpu_has_avx512_bf16(); }

bool shape_supported(int64_t n, int64_t k) { return n > 0 && k > 0 && n % kPanel == 0 && k % 2 == 0; }

void check_bf16_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
}

at::Tensor pack(const at::Tensor& weight, bool glu) {
  check_bf16_cpu(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "weight must be [N, K], got ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(shape_supported(N, K), "gemm_bf16 packs N a multiple of ", kPanel, " and K even (both > 0), got [",
              N, ", ", K, "]");
  at::Tensor rows = weight.contiguous();
  if (glu)   // gate rows [32p, 32p + 32), then the same up rows, for each panel p
    rows = rows.view({2, N / kPanel, kPanel / 2, K}).permute({1, 0, 2, 3}).contiguous();
  // [N/64, 64, K] -> [N/64, K/2, 64, 2]: channel c's pair (k, k+1) at [p][k/2][c][0..1]
  return rows.view({N / kPanel, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor product(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& out, Layout layout) {
  TORCH_CHECK(available(), "gemm_bf16 needs a CPU with AVX512-BF16");
  check_bf16_cpu(x, "x");
  check_bf16_cpu(packed, "packed");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanel && packed.size(3) == 2 && packed.is_contiguous(),
              "packed must come from pack_gemm_bf16 ([N/64, K/2, 64, 2], contiguous), got ", packed.sizes());
  const int64_t K = packed.size(1) * 2, M = x.dim() == 2 ? x.size(0) : -1;
  const int64_t N = layout == Layout::kSiluMul ? packed.size(0) * kPanel / 2 : packed.size(0) * kPanel;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.stride(1) == 1 && (M <= 1 || x.stride(0) >= K),
              "x must be [M, ", K, "] with contiguous rows, got ", x.sizes(), " strides ", x.strides());
  at::Tensor y;
  if (out.has_value()) {
    y = *out;
    check_bf16_cpu(y, "out");
    TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.stride(1) == 1 && (M <= 1 || y.stride(0) >= N),
                "out must be [", M, ", ", N, "] with contiguous rows, got ", y.sizes(), " strides ", y.strides());
  } else {
    y = at::empty({M, N}, x.options());
  }
  if (M == 0) return y;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t ldx = M > 1 ? x.stride(0) : K, ldy = M > 1 ? y.stride(0) : N;
  const int64_t panels = packed.size(0), chunks = (M + kChunkRows - 1) / kChunkRows, pairs = K / 2;
  const int64_t column = layout == Layout::kPlain ? kPanel : kPanel / 2, up = panels * kPanel / 2;
  // A weight past any L3 share (the LM head) is read from memory once, each thread walking its
  // panels with all the rows (re-read from cache); a smaller one stays cached across row chunks.
  const bool panel_major = packed.numel() * 2 > kStreamedWeightBytes;
  auto run = layout == Layout::kPlain ? rows_times_panel<Layout::kPlain>
             : layout == Layout::kGlu ? rows_times_panel<Layout::kGlu> : rows_times_panel<Layout::kSiluMul>;
  // Threads take runs of consecutive items in turn from a shared counter, about 16 runs a thread: one
  // descheduled by another process on the machine delays its own run, not a fixed half of the product.
  const int64_t items = panels * chunks, threads = std::min<int64_t>(at::get_num_threads(), items);
  const int64_t run_items = std::max<int64_t>(1, items / (threads * 16));
  std::atomic<int64_t> next{0};
  {
    pybind11::gil_scoped_release release;
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t i0 = next.fetch_add(run_items, std::memory_order_relaxed); i0 < items;
           i0 = next.fetch_add(run_items, std::memory_order_relaxed)) {
        for (int64_t i = i0; i < std::min(items, i0 + run_items); ++i) {
          const int64_t c = panel_major ? i % chunks : i / panels, p = panel_major ? i / chunks : i % panels;
          const int64_t r0 = c * kChunkRows;
          run(xp + r0 * ldx, ldx, std::min(kChunkRows, M - r0), wp + p * pairs * 2 * kPanel, pairs,
              yp + r0 * ldy + p * column, ldy, up);
        }
      }
    });
  }
  return y;
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& out, bool glu) {
  return product(x, packed, out, glu ? Layout::kGlu : Layout::kPlain);
}

at::Tensor gemm_silu_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& out) {
  return product(x, packed, out, Layout::kSiluMul);
}

}  // namespace

void register_gemm_bf16(pybind11::module_& m) {
  m.def("gemm_bf16_available", &available, "True where the CPU has AVX512-BF16 (gemm_bf16 runs)");
  m.def("gemm_bf16_shape_supported", &shape_supported, "True where pack_gemm_bf16 packs a [N, K] weight",
        py::arg("n"), py::arg("k"));
  m.def("pack_gemm_bf16", &pack,
        "pack_gemm_bf16(weight [N, K] bfloat16, glu=False) -> the packed weight gemm_bf16 takes (glu: a gate-up "
        "weight, gate rows then up rows, for gemm_bf16_silu_mul too)",
        py::arg("weight"), py::arg("glu") = false);
  m.def("gemm_bf16", &gemm,
        "gemm_bf16(x [M, K] bfloat16, packed, out=None, glu=False) -> x @ weight.T [M, N] bfloat16, into out when "
        "given; glu as the weight was packed",
        py::arg("x"), py::arg("packed"), py::arg("out") = py::none(), py::arg("glu") = false);
  m.def("gemm_bf16_silu_mul", &gemm_silu_mul,
        "gemm_bf16_silu_mul(x [M, K] bfloat16, packed, out=None) -> silu_mul(x @ weight.T) [M, N/2] bfloat16 for a "
        "weight packed with glu=True",
        py::arg("x"), py::arg("packed"), py::arg("out") = py::none());
}
