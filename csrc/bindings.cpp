// Python binding of the KV store (rpart._kernels). Validates shapes and
// dtypes of every array, releases the GIL for all work, and maps the store's
// errors to KeyError / ValueError / _kernels.CapacityError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <utility>

#include "kv_store.h"
#include "stream.h"

namespace py = pybind11;


using fd::DType;
using fd::Input;

namespace {

std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

std::string strides_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.strides(i));
  return s + ")";
}

// A float32 / float16 / bfloat16 (numpy uint16: numpy has no bfloat16; its bits) array of the given
// rank, each row (index of the first dimension) C-contiguous; the rows may lie further apart (a view
// of a wider buffer), at a whole number of elements, never overlapping.
Input float_input(const py::array& a, const char* name, int ndim) {
  if (a.ndim() != ndim)
    throw py::value_error(std::string(name) + " must have " + std::to_string(ndim) + " dimensions, got shape " +
                          shape_str(a));
  const py::dtype dt = a.dtype();
  Input in;
  in.data = a.data();
  if (dt.kind() == 'f' && dt.itemsize() == 4)
    in.dtype = DType::f32;
  else if (dt.kind() == 'f' && dt.itemsize() == 2)
    in.dtype = DType::f16;
  else if (dt.kind() == 'u' && dt.itemsize() == 2)
    in.dtype = DType::bf16;
  else
    throw py::value_error(std::string(name) + " must be float32, float16 or bfloat16 (as uint16), got " +
                          std::string(py::str(dt)));
  const py::ssize_t item = dt.itemsize();
  py::ssize_t len = 1, expect = item;
  const bool empty = a.size() == 0;  // any strides
  for (py::ssize_t d = a.ndim() - 1; d >= 1; --d) {  // the rows themselves: C-contiguous
    if (!empty && a.shape(d) > 1 && a.strides(d) != expect)
      throw py::value_error(std::string(name) + " must be C-contiguous within each row (index of its first "
                            "dimension), got shape " + shape_str(a) + " strides " + strides_str(a));
    expect *= a.shape(d);
    len *= a.shape(d);
  }
  py::ssize_t row = len;
  if (!empty && a.shape(0) > 1) {
    const py::ssize_t s0 = a.strides(0);
    if (s0 < len * item || s0 % item != 0)
      throw py::value_error(std::string(name) + " has rows that overlap or are not a whole number of elements "
                            "apart: shape " + shape_str(a) + " strides " + strides_str(a));
    row = s0 / item;
  }
  in.row = static_cast<size_t>(row);
  in.row_len = static_cast<size_t>(len);
  return in;
}

// int64 sequence ids (or lens), 1-D, C-contiguous.
const int64_t* int_input(const py::array& a, const char* name) {
  if (a.ndim() != 1) throw py::value_error(std::string(name) + " must be 1-D, got shape " + shape_str(a));
  const py::dtype dt = a.dtype();
  if (!(dt.kind() == 'i' && dt.itemsize() == 8)) throw py::value_error(std::string(name) + " must be int64");
  if (!(a.flags() & py::array::c_style)) throw py::value_error(std::string(name) + " must be contiguous");
  return static_cast<const int64_t*>(a.data());
}

// The kernel paths by name, as Python spells them ("auto" is resolved by the store's shape).
constexpr std::pair<const char*, fd::Isa> kIsaNames[] = {
    {"avx512vnni", fd::Isa::avx512vnni}, {"avx512", fd::Isa::avx512}, {"avx2", fd::Isa::avx2}, {"scalar", fd::Isa::scalar}};

bool isa_from_name(const std::string& name, fd::Isa* isa) {
  for (const auto& [n, i] : kIsaNames)
    if (name == n) return *isa = i, true;
  return false;
}

class PyKVStore {
 public:
  PyKVStore(int num_layers, int num_kv_heads, int head_dim, int64_t capacity_bytes, int block_size,
            const std::string& kv_format, int num_threads, const std::string& isa, bool fp16_tail, int k_group,
            int v_group, bool openmp, bool populate) {
    if (kv_format != "fp16" && kv_format != "int4")
      throw py::value_error("kv_format must be 'fp16' or 'int4', got '" + kv_format + "'");
    if (capacity_bytes <= 0) throw py::value_error("capacity_bytes must be > 0");
    const bool int4 = kv_format == "int4";
    fd::Isa chosen;
    if (isa == "auto") {
      if (num_layers < 1 || num_kv_heads < 1 || head_dim < 1 || block_size < 1)
        throw py::value_error("num_layers, num_kv_heads, head_dim and block_size must be >= 1");
      // the store's own limits, before Layout::make: its arithmetic overflows int beyond them
      if (head_dim > 4096 || block_size > 4096 || num_kv_heads > 4096)
        throw py::value_error("head_dim, block_size and num_kv_heads must be <= 4096");
      auto valid = [&](int g) { return int4 && fd::valid_group(g, head_dim) ? g : 0; };  // the store checks them
      chosen = fd::best_isa(fd::Layout::make(num_kv_heads, head_dim, block_size, int4, valid(k_group), valid(v_group)));
    } else if (!isa_from_name(isa, &chosen)) {
      throw py::value_error("isa must be 'auto', 'avx512vnni', 'avx512', 'avx2' or 'scalar', got '" + isa + "'");
    }
    store_ = std::make_unique<fd::KVStore>(num_layers, num_kv_heads, head_dim, static_cast<size_t>(capacity_bytes),
                                           block_size, int4, num_threads, chosen, fp16_tail, k_group, v_group,
                                           openmp, populate);
    kv_format_ = kv_format;
  }

  std::string isa() const {
    for (const auto& [n, i] : kIsaNames)
      if (store_->isa() == i) return n;
    return "scalar";
  }

  void create(const py::array& ids) {
    const int64_t* p = int_input(ids, "seq_ids");
    const int n = static_cast<int>(ids.shape(0));
    py::gil_scoped_release nogil;
    store_->create(p, n);
  }

  void free(const py::array& ids) {
    const int64_t* p = int_input(ids, "seq_ids");
    const int n = static_cast<int>(ids.shape(0));
    py::gil_scoped_release nogil;
    store_->free(p, n);
  }

  bool has(int64_t id) {
    py::gil_scoped_release nogil;
    return store_->has(id);
  }

  int length(int64_t id, int layer) {
    py::gil_scoped_release nogil;
    return store_->length(id, layer);
  }

  std::vector<int32_t> block_ids(int64_t id, int layer) {
    py::gil_scoped_release nogil;
    return store_->block_ids(id, layer);
  }

  void append(int layer, const py::array& ids, const py::array& k, const py::array& v) {
    const int64_t* p = int_input(ids, "seq_ids");
    const int B = static_cast<int>(ids.shape(0));
    const Input ki = float_input(k, "k", 3), vi = float_input(v, "v", 3);
    check_kv_shape(k, "k", B);
    check_kv_shape(v, "v", B);
    py::gil_scoped_release nogil;
    store_->append(layer, p, B, ki, vi);
  }

  void append_span(int layer, const py::array& ids, const py::array& lens, const py::array& k, const py::array& v) {
    const int64_t* p = int_input(ids, "seq_ids");
    const int64_t* lp = int_input(lens, "lens");
    const int B = static_cast<int>(ids.shape(0));
    if (lens.shape(0) != B)
      throw py::value_error("lens has " + std::to_string(lens.shape(0)) + " entries for " + std::to_string(B) +
                            " sequences");
    int64_t total = 0;
    for (int i = 0; i < B; ++i) {
      if (lp[i] < 0 || lp[i] > fd::kMaxSpanTokens || __builtin_add_overflow(total, lp[i], &total))
        throw py::value_error("lens must be in [0, " + std::to_string(fd::kMaxSpanTokens) + "] with a sum that fits");
    }
    const Input ki = float_input(k, "k", 3), vi = float_input(v, "v", 3);
    check_kv_shape(k, "k", total);
    check_kv_shape(v, "v", total);
    py::gil_scoped_release nogil;
    store_->append_span(layer, p, B, lp, ki, vi);
  }

  // The output [B, H, D]: float32, or with bf16_out bfloat16 bits (uint16).
  py::array output(int B, int H, bool bf16_out) {
    const std::vector<py::ssize_t> shape{B, H, static_cast<py::ssize_t>(store_->layout().head_dim)};
    if (bf16_out) return py::array_t<uint16_t>(shape);
    return py::array_t<float>(shape);
  }

  py::array attend(int layer, const py::array& ids, const py::array& q, py::object scale, bool bf16_out) {
    const int64_t* p = int_input(ids, "seq_ids");
    const int B = static_cast<int>(ids.shape(0));
    const Input qi = float_input(q, "q", 3);
    const int H = check_q_shape(q, B);
    const float sc = scale_of(scale);
    py::array out = output(B, H, bf16_out);
    void* o = out.mutable_data();
    {
      py::gil_scoped_release nogil;
      store_->attend(layer, p, B, H, qi, sc, bf16_out ? nullptr : static_cast<float*>(o),
                     bf16_out ? static_cast<uint16_t*>(o) : nullptr);
    }
    return out;
  }

  py::array decode(int layer, const py::array& ids, const py::array& q, const py::array& k, const py::array& v,
                   py::object scale, bool bf16_out) {
    const int64_t* p = int_input(ids, "seq_ids");
    const int B = static_cast<int>(ids.shape(0));
    const Input qi = float_input(q, "q", 3), ki = float_input(k, "k", 3), vi = float_input(v, "v", 3);
    const int H = check_q_shape(q, B);
    check_kv_shape(k, "k", B);
    check_kv_shape(v, "v", B);
    const float sc = scale_of(scale);
    py::array out = output(B, H, bf16_out);
    void* o = out.mutable_data();
    {
      py::gil_scoped_release nogil;
      store_->decode(layer, p, B, H, qi, ki, vi, sc, bf16_out ? nullptr : static_cast<float*>(o),
                     bf16_out ? static_cast<uint16_t*>(o) : nullptr);
    }
    return out;
  }

  py::tuple read(int64_t id, int layer) {
    std::vector<float> k, v;
    {
      py::gil_scoped_release nogil;
      store_->read(id, layer, &k, &v);
    }
    const auto& L = store_->layout();
    const py::ssize_t n = static_cast<py::ssize_t>(k.size() / (static_cast<size_t>(L.num_kv_heads) * L.head_dim));
    py::array_t<float> ka({n, static_cast<py::ssize_t>(L.num_kv_heads), static_cast<py::ssize_t>(L.head_dim)});
    py::array_t<float> va({n, static_cast<py::ssize_t>(L.num_kv_heads), static_cast<py::ssize_t>(L.head_dim)});
    if (!k.empty()) {
      std::memcpy(ka.mutable_data(), k.data(), k.size() * sizeof(float));
      std::memcpy(va.mutable_data(), v.data(), v.size() * sizeof(float));
    }
    return py::make_tuple(ka, va);
  }

  bool wait_populated(double timeout_s) {
    if (!(timeout_s >= 0.0)) throw py::value_error("timeout_s must be >= 0");
    py::gil_scoped_release nogil;
    return store_->wait_populated(timeout_s);
  }

  py::dict stats() {
    fd::StoreStats s;
    {
      py::gil_scoped_release nogil;
      s = store_->stats();
    }
    py::dict d;
    d["sequences"] = s.sequences;
    d["kv_tokens"] = s.kv_tokens;
    d["blocks_used"] = s.blocks_used;
    d["blocks_total"] = s.blocks_total;
    d["bytes_used"] = s.bytes_used;
    d["capacity_bytes"] = s.capacity_bytes;
    d["tail_blocks_used"] = s.tail_blocks_used;
    d["populated_bytes"] = s.populated_bytes;
    d["tail_blocks_total"] = s.tail_blocks_total;
    return d;
  }

  void set_threads(int n) {
    py::gil_scoped_release nogil;
    store_->set_threads(n);
  }

  void close() {
    py::gil_scoped_release nogil;
    store_->close();
  }

  int num_layers() const { return store_->num_layers(); }
  int num_kv_heads() const { return store_->layout().num_kv_heads; }
  int head_dim() const { return store_->layout().head_dim; }
  int block_size() const { return store_->layout().block_size; }
  int64_t block_bytes() const { return static_cast<int64_t>(store_->layout().block_bytes); }  // may pass 2 GiB
  int k_group() const { return store_->layout().kgroup; }
  int v_group() const { return store_->layout().vgroup; }
  int num_threads() const { return store_->num_threads(); }
  bool openmp() const { return store_->openmp(); }
  const std::string& kv_format() const { return kv_format_; }

 private:
  void check_kv_shape(const py::array& a, const char* name, int64_t rows) const {
    const auto& L = store_->layout();
    if (a.shape(0) != rows || a.shape(1) != L.num_kv_heads || a.shape(2) != L.head_dim)
      throw py::value_error(std::string(name) + " must have shape (" + std::to_string(rows) + ", " +
                            std::to_string(L.num_kv_heads) + ", " + std::to_string(L.head_dim) + "), got " +
                            shape_str(a));
  }

  int check_q_shape(const py::array& q, int B) const {
    const auto& L = store_->layout();
    const py::ssize_t H = q.shape(1);
    if (q.shape(0) != B || q.shape(2) != L.head_dim || H < 1 || H % L.num_kv_heads || H > 64 * L.num_kv_heads)
      throw py::value_error("q must have shape (" + std::to_string(B) + ", H, " + std::to_string(L.head_dim) +
                            ") with H a multiple of num_kv_heads " + std::to_string(L.num_kv_heads) + ", got " +
                            shape_str(q));
    return static_cast<int>(H);
  }

  float scale_of(const py::object& scale) const {
    if (scale.is_none()) return 1.0f / std::sqrt(static_cast<float>(store_->layout().head_dim));
    const double s = scale.cast<double>();
    if (!std::isfinite(s) || s <= 0) throw py::value_error("scale must be a positive finite number");
    return static_cast<float>(s);
  }

  std::unique_ptr<fd::KVStore> store_;
  std::string kv_format_;
};

}  // namespace

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "fastdecode R-Part kernel: paged fp16/int4 KV store and decode attention";
  // Types and the translator are module-local: two builds of this module can then be loaded in one
  // process side by side (bench/kernel_ab.py); global ones collide ("type already registered").
  static py::exception<fd::CapacityErr> capacity_error(m, "CapacityError", PyExc_RuntimeError);
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const fd::KeyErr& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    } catch (const fd::ValueErr& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const fd::CapacityErr& e) {
      PyErr_SetString(capacity_error.ptr(), e.what());
    } catch (const std::bad_alloc&) {
      PyErr_SetString(PyExc_MemoryError, "out of memory");
    }
  });
  m.def("cpu_supports", [](const std::string& isa) {
    fd::Isa chosen;
    if (!isa_from_name(isa, &chosen)) throw py::value_error("unknown isa '" + isa + "'");
    return fd::isa_supported(chosen, fd::Layout::make(1, 64, 16, false), nullptr);
  });
  py::class_<fd::StreamBuffer>(m, "StreamBuffer",
                               "STREAM-style read bandwidth over a buffer mapped like the KV pool (huge pages)",
                               py::module_local())
      .def(py::init([](int64_t bytes, bool hugepages) {
             if (bytes <= 0) throw py::value_error("bytes must be > 0");
             return std::make_unique<fd::StreamBuffer>(static_cast<size_t>(bytes), hugepages);
           }),
           py::arg("bytes"), py::arg("hugepages") = true)
      .def_property_readonly("bytes", &fd::StreamBuffer::bytes)
      .def(
          "read",
          [](fd::StreamBuffer& b, int threads) {
            if (threads < 1) throw py::value_error("threads must be >= 1");
            py::gil_scoped_release nogil;
            return b.read(threads);
          },
          py::arg("threads"), "GB/s of one pass over the buffer with `threads` threads");
  py::class_<PyKVStore>(m, "KVStore", py::module_local())
      .def(py::init<int, int, int, int64_t, int, const std::string&, int, const std::string&, bool, int, int, bool,
                    bool>(),
           py::arg("num_layers"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("capacity_bytes"),
           py::arg("block_size") = 16, py::arg("kv_format") = "fp16", py::arg("num_threads") = 0,
           py::arg("isa") = "auto", py::arg("fp16_tail") = false, py::arg("k_group") = 0, py::arg("v_group") = 0,
           py::arg("openmp") = false, py::arg("populate") = false)
      .def_property_readonly("isa", &PyKVStore::isa)
      .def_property_readonly("num_layers", &PyKVStore::num_layers)
      .def_property_readonly("num_kv_heads", &PyKVStore::num_kv_heads)
      .def_property_readonly("head_dim", &PyKVStore::head_dim)
      .def_property_readonly("block_size", &PyKVStore::block_size)
      .def_property_readonly("block_bytes", &PyKVStore::block_bytes)
      .def_property_readonly("k_group", &PyKVStore::k_group)
      .def_property_readonly("v_group", &PyKVStore::v_group)
      .def_property_readonly("num_threads", &PyKVStore::num_threads)
      .def_property_readonly("openmp", &PyKVStore::openmp)
      .def_property_readonly("kv_format", &PyKVStore::kv_format)
      .def("create", &PyKVStore::create)
      .def("free", &PyKVStore::free)
      .def("has", &PyKVStore::has)
      .def("length", &PyKVStore::length, py::arg("seq_id"), py::arg("layer") = 0)
      .def("block_ids", &PyKVStore::block_ids, py::arg("seq_id"), py::arg("layer") = 0)
      .def("append", &PyKVStore::append)
      .def("append_span", &PyKVStore::append_span)
      .def("attend", &PyKVStore::attend, py::arg("layer"), py::arg("seq_ids"), py::arg("q"),
           py::arg("scale") = py::none(), py::arg("bf16_out") = false)
      .def("decode", &PyKVStore::decode, py::arg("layer"), py::arg("seq_ids"), py::arg("q"), py::arg("k"),
           py::arg("v"), py::arg("scale") = py::none(), py::arg("bf16_out") = false)
      .def("read", &PyKVStore::read)
      .def("stats", &PyKVStore::stats)
      .def("wait_populated", &PyKVStore::wait_populated, py::arg("timeout_s"))
      .def("set_threads", &PyKVStore::set_threads)
      .def("close", &PyKVStore::close);
}
