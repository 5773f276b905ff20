// fp32 linear layers on weights packed once by MKL (fastdecode/model/packed.py).
// torch's fp32 F.linear on the CPU calls MKL's cblas_sgemm, which copies the weight into its
// panel layout on every call; MKL's pack/compute pair does that copy once, at load. A row's
// result does not depend on how many rows a call has once they are 12 or more or a multiple of
// 4 (tests/test_packed_linear.py); below, MKL on AMD sums in another order (1e-6 relative).
// torch's CPU wheel carries MKL inside libtorch_cpu; its three entry points are looked up at
// run time, so a torch without MKL still loads this module (available() is then false and the
// model keeps F.linear).
#include <torch/extension.h>

#include <dlfcn.h>

#include <climits>
#include <cstdint>
#include <cstring>

#include "packed_gemm.h"

namespace {

enum : int { kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162 };
constexpr int kPackRows = 256;    // the m MKL is told when packing B; the layout does not depend on it

struct Mkl {
  size_t (*get_size)(int, int, int, int) = nullptr;
  void (*pack)(int, int, int, int, int, int, float, const float*, int, float*) = nullptr;
  void (*compute)(int, int, int, int, int, int, const float*, int, const float*, int, float, float*, int) = nullptr;
};

const Mkl* mkl() {
  static const Mkl found = [] {
    Mkl m;
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    if (lib == nullptr) return m;
    m.get_size = reinterpret_cast<decltype(m.get_size)>(dlsym(lib, "cblas_sgemm_pack_get_size"));
    m.pack = reinterpret_cast<decltype(m.pack)>(dlsym(lib, "cblas_sgemm_pack"));
    m.compute = reinterpret_cast<decltype(m.compute)>(dlsym(lib, "cblas_sgemm_compute"));
    return m;
  }();
  return found.get_size && found.pack && found.compute ? &found : nullptr;
}

// A packed weight is one uint8 tensor: this header, then MKL's buffer. MKL's buffer must stay at
// the address it was packed at, so the header keeps that address and every call checks it
// (a clone or a .to() of the tensor is refused, not misread).
struct Header {
  uint64_t magic;
  uint64_t data_address;
  int64_t n, k;
  uint64_t bytes;
};
constexpr uint64_t kMagic = 0x6664736770616b31ull;   // "fdsgpak1"
constexpr int64_t kDataOffset = 64;                   // keeps MKL's buffer 64-byte aligned

const Header& header_of(const at::Tensor& packed) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 1 &&
                  packed.is_contiguous() && packed.numel() >= kDataOffset,
              "packed must be a weight packed by pack_linear_weight");
  const auto* h = reinterpret_cast<const Header*>(packed.data_ptr<uint8_t>());
  TORCH_CHECK(h->magic == kMagic, "packed must be a weight packed by pack_linear_weight");
  TORCH_CHECK(static_cast<uint64_t>(packed.numel()) >= kDataOffset + h->bytes, "packed weight is truncated");
  TORCH_CHECK(h->data_address == reinterpret_cast<uint64_t>(packed.data_ptr<uint8_t>() + kDataOffset),
              "packed weight was copied to another address (MKL's packed layout cannot move); pack it again");
  return *h;
}

bool available() { return mkl() != nullptr; }

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  const Mkl* m = mkl();
  TORCH_CHECK(m != nullptr, "this torch has no MKL packed GEMM (cblas_sgemm_pack)");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "weight must be a float32 CPU tensor [out_features, in_features]");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n > 0 && k > 0 && n < INT_MAX && k < INT_MAX, "weight dimensions must be in [1, 2^31)");
  const at::Tensor w = weight.contiguous();
  const uint64_t bytes = m->get_size(kBMatrix, kPackRows, static_cast<int>(n), static_cast<int>(k));
  at::Tensor packed = at::empty({static_cast<int64_t>(kDataOffset + bytes)}, weight.options().dtype(at::kByte));
  uint8_t* base = packed.data_ptr<uint8_t>();
  float* data = reinterpret_cast<float*>(base + kDataOffset);
  const Header h{kMagic, reinterpret_cast<uint64_t>(data), n, k, bytes};
  std::memcpy(base, &h, sizeof h);
  m->pack(kRowMajor, kBMatrix, kTrans, kPackRows, static_cast<int>(n), static_cast<int>(k), 1.0f,
          w.data_ptr<float>(), static_cast<int>(k), data);
  return packed;
}

// x [M, K] float32 (rows may be strided) @ weight.T (+ bias) -> [M, N], into out when given.
at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& out_opt) {
  const Mkl* m = mkl();
  TORCH_CHECK(m != nullptr, "this torch has no MKL packed GEMM (cblas_sgemm_compute)");
  const Header& h = header_of(packed);
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "x must be a float32 CPU tensor [rows, in_features]");
  TORCH_CHECK(x_in.size(1) == h.k, "x has ", x_in.size(1), " features, the weight takes ", h.k);
  const int64_t rows = x_in.size(0);
  TORCH_CHECK(rows < INT_MAX, "too many rows for one product");
  const at::Tensor x = (x_in.stride(1) == 1 && x_in.stride(0) >= h.k) ? x_in : x_in.contiguous();
  at::Tensor out;
  if (out_opt.has_value()) {
    out = *out_opt;
    TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 &&
                    out.size(0) == rows && out.size(1) == h.n && out.stride(1) == 1 && out.stride(0) >= h.n,
                "out must be a float32 CPU tensor [", rows, ", ", h.n, "] with contiguous rows");
  } else {
    out = at::empty({rows, h.n}, x.options());
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                    bias->size(0) == h.n, "bias must be a float32 CPU tensor [", h.n, "]");
  }
  if (rows == 0) return out;
  TORCH_CHECK(x.stride(0) < INT_MAX && out.stride(0) < INT_MAX, "row strides must be below 2^31");
  {
    pybind11::gil_scoped_release release;
    m->compute(kRowMajor, kNoTrans, kPacked, static_cast<int>(rows), static_cast<int>(h.n), static_cast<int>(h.k),
               x.data_ptr<float>(), static_cast<int>(x.stride(0)),
               reinterpret_cast<const float*>(packed.data_ptr<uint8_t>() + kDataOffset), static_cast<int>(h.k), 0.0f,
               out.data_ptr<float>(), static_cast<int>(out.stride(0)));
  }
  if (bias.has_value()) out.add_(*bias);
  return out;
}

}  // namespace

void register_packed_gemm(pybind11::module_& m) {
  m.def("mkl_packing_available", &available, "True where torch carries MKL's packed sgemm");
  m.def("pack_linear_weight", &pack_linear_weight,
        "pack_linear_weight(weight [N, K] float32) -> uint8 tensor: the weight packed once for MKL",
        py::arg("weight"));
  m.def("packed_linear", &packed_linear,
        "packed_linear(x [M, K] float32, packed, bias=None, out=None) -> x @ weight.T (+ bias) [M, N]",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), py::arg("out") = py::none());
}
