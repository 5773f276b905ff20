#include "kv_store.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <unordered_set>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace fd {

namespace {

constexpr size_t kHugePage = size_t(2) << 20;

// int4 with fp16 tails: the staging area takes 1/kTailShare of the capacity.
constexpr size_t kTailShare = 8;

// Below this many (token x kv head) per call, waking the other threads costs more than it saves.
constexpr int64_t kParallelMin = 4096;

// Decode appends: sequences ahead whose destination lines are requested before the current write.
constexpr size_t kWriteAhead = 2;


std::string id_str(int64_t id) { return std::to_string(id); }

// Group-wise asymmetric int4: x ~= scale * u + zero, u in 0..15; scale, zero stored as fp16
// (rounded first, then u computed against the rounded values, so the stored triple is exact).
void quantize_group(const float* x, int n, uint8_t* u, uint16_t* scale_h, uint16_t* zero_h) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  const uint16_t zh = f2h(lo);
  const float z = h2f(zh);
  const float range = hi - z;
  uint16_t sh = f2h(range / 15.0f);
  if (h2f(sh) * 15.0f < range && (sh & 0x7c00u) != 0x7c00u) ++sh;  // never too small to reach hi
  const float s = h2f(sh);
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  for (int i = 0; i < n; ++i) {
    const float q = std::nearbyint((x[i] - z) * inv);
    u[i] = static_cast<uint8_t>(q < 0.0f ? 0.0f : (q > 15.0f ? 15.0f : q));
  }
  *scale_h = sh;
  *zero_h = zh;
}

// Bulk fp32 <-> fp16 for appends: F16C when the CPU has it, else the portable routines.
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx,f16c"))) void to_half_f16c(const float* x, uint16_t* y, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) y[i] = f2h(x[i]);
}
__attribute__((target("avx,f16c"))) void to_float_f16c(const uint16_t* x, float* y, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
  for (; i < n; ++i) y[i] = h2f(x[i]);
}
__attribute__((target("avx2,f16c"))) void bf16_to_half_avx2(const uint16_t* x, uint16_t* y, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    const __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) y[i] = f2h(bf2f(x[i]));
}
const bool kHasF16C = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
const bool kHasAVX2F16C = kHasF16C && __builtin_cpu_supports("avx2");
#else
const bool kHasF16C = false, kHasAVX2F16C = false;
void to_half_f16c(const float*, uint16_t*, size_t) {}
void to_float_f16c(const uint16_t*, float*, size_t) {}
void bf16_to_half_avx2(const uint16_t*, uint16_t*, size_t) {}
#endif

void to_half(const float* x, uint16_t* y, size_t n) {
  if (kHasF16C) return to_half_f16c(x, y, n);
  for (size_t i = 0; i < n; ++i) y[i] = f2h(x[i]);
}

void to_float(const uint16_t* x, float* y, size_t n) {
  if (kHasF16C) return to_float_f16c(x, y, n);
  for (size_t i = 0; i < n; ++i) y[i] = h2f(x[i]);
}

}  // namespace

void Input::floats(size_t at, float* y, size_t n) const {
  if (dtype == DType::f32) {
    std::memcpy(y, static_cast<const float*>(data) + at, n * 4);
  } else if (dtype == DType::f16) {
    to_float(static_cast<const uint16_t*>(data) + at, y, n);
  } else {
    const uint16_t* x = static_cast<const uint16_t*>(data) + at;
    for (size_t i = 0; i < n; ++i) y[i] = bf2f(x[i]);
  }
}

const uint16_t* Input::halves(size_t at, uint16_t* scratch, size_t n) const {
  if (dtype == DType::f16) return static_cast<const uint16_t*>(data) + at;
  if (dtype == DType::f32) {
    to_half(static_cast<const float*>(data) + at, scratch, n);
  } else if (kHasAVX2F16C) {
    bf16_to_half_avx2(static_cast<const uint16_t*>(data) + at, scratch, n);
  } else {
    alignas(64) float x[4096];
    floats(at, x, n);
    to_half(x, scratch, n);
  }
  return scratch;
}

namespace {

// One token of one kv head into an fp16 region (layout L): K transposed, V as a row; the token is
// row src of k and v, the head h.
void write_fp16_head(const Layout& L, uint8_t* head, int slot, const Input& k, const Input& v, size_t src, int h) {
  const int D = L.head_dim;
  const size_t c = static_cast<size_t>(h) * D;
  alignas(64) uint16_t kh[4096], vh[4096];
  const uint16_t* ks = k.halves(k.offset(src, c), kh, D);
  const uint16_t* vs = v.halves(v.offset(src, c), vh, D);
  uint16_t* K = reinterpret_cast<uint16_t*>(head + L.k_off);
  for (int d = 0; d < D; ++d) K[static_cast<size_t>(d) * L.bsp + slot] = ks[d];
  std::memcpy(head + L.v_off + static_cast<size_t>(slot) * D * 2, vs, static_cast<size_t>(D) * 2);
}

}  // namespace

bool isa_supported(Isa isa, const Layout& L, std::string* why) {
  auto no = [&](const std::string& w) {
    if (why) *why = w;
    return false;
  };
  switch (isa) {
    case Isa::scalar:
      return true;
    case Isa::avx2:
#if defined(__x86_64__) || defined(__i386__)
      if (!avx2_items()) return no("avx2 kernels not built for this target");
      if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
        return no("this CPU lacks avx2/fma/f16c");
      if (L.head_dim % 16) return no("avx2 path needs head_dim % 16 == 0");
      return true;
#else
      return no("avx2 kernels not built for this target");
#endif
    case Isa::avx512:
#if defined(__x86_64__)
      if (!avx512_items()) return no("avx512 kernels not built for this target");
      if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")))
        return no("this CPU lacks avx512f/bw/vl/dq");
      if (L.head_dim % 16) return no("avx512 path needs head_dim % 16 == 0");
      if (L.int4 && L.vgroup % 32) return no("avx512 int4 path needs a value group of 32 or more channels");
      return true;
#else
      return no("avx512 kernels not built for this target");
#endif
    case Isa::avx512vnni:
#if defined(__x86_64__)
      if (!avx512vnni_items()) return no("avx512vnni kernels not built for this target");
      if (!isa_supported(Isa::avx512, L, why)) return false;
      if (!__builtin_cpu_supports("avx512vnni")) return no("this CPU lacks avx512vnni");
      return true;
#else
      return no("avx512vnni kernels not built for this target");
#endif
  }
  return no("unknown isa");
}

Isa best_isa(const Layout& L) {
  if (isa_supported(Isa::avx512vnni, L, nullptr)) return Isa::avx512vnni;
  if (isa_supported(Isa::avx512, L, nullptr)) return Isa::avx512;
  if (isa_supported(Isa::avx2, L, nullptr)) return Isa::avx2;
  return Isa::scalar;
}

KVStore::KVStore(int num_layers, int num_kv_heads, int head_dim, size_t capacity_bytes, int block_size, bool int4,
                 int num_threads, Isa isa, bool fp16_tail, int k_group, int v_group, bool openmp, bool populate)
    : num_layers_(num_layers), isa_(isa), capacity_bytes_(capacity_bytes), openmp_(openmp) {
  if (num_layers < 1 || num_kv_heads < 1 || head_dim < 1 || block_size < 1)
    throw ValueErr("num_layers, num_kv_heads, head_dim and block_size must be >= 1");
  if (head_dim > 4096 || block_size > 4096 || num_kv_heads > 4096)
    throw ValueErr("head_dim, block_size and num_kv_heads must be <= 4096");
  if (int4 && head_dim % 16)
    throw ValueErr("int4 KV needs head_dim % 16 == 0, got " + std::to_string(head_dim));
  if (num_threads < 0) throw ValueErr("num_threads must be >= 0");
  for (const auto& [name, group] : {std::pair{"k_group", k_group}, std::pair{"v_group", v_group}}) {
    if (group == 0) continue;
    if (!int4) throw ValueErr(std::string(name) + " applies to int4 KV only");
    if (!valid_group(group, head_dim))
      throw ValueErr(std::string(name) + " must be 16, 32, 64 or 128 channels dividing head_dim " +
                     std::to_string(head_dim) + ", got " + std::to_string(group));
  }
  L_ = Layout::make(num_kv_heads, head_dim, block_size, int4, k_group, v_group);
  std::string why;
  if (!isa_supported(isa, L_, &why)) throw ValueErr("isa not supported: " + why);
  items_ = isa == Isa::avx512vnni ? avx512vnni_items()
           : isa == Isa::avx512   ? avx512_items()
           : isa == Isa::avx2     ? avx2_items()
                                  : scalar_items();

  T_ = Layout::make(num_kv_heads, head_dim, block_size, false);
  const size_t tail_bytes = int4 && fp16_tail ? capacity_bytes / kTailShare : 0;
  ntails_ = static_cast<int32_t>(std::min<size_t>(tail_bytes / T_.block_bytes, std::numeric_limits<int32_t>::max()));
  const size_t nb = (capacity_bytes - static_cast<size_t>(ntails_) * T_.block_bytes) / L_.block_bytes;
  if (nb < 1)
    throw ValueErr("capacity_bytes " + std::to_string(capacity_bytes) + " is less than one block (" +
                   std::to_string(L_.block_bytes) + " bytes)");
  nblocks_ = static_cast<int32_t>(std::min<size_t>(nb, std::numeric_limits<int32_t>::max()));
  const size_t pool_bytes = static_cast<size_t>(nblocks_) * L_.block_bytes;
  const size_t used = pool_bytes + static_cast<size_t>(ntails_) * T_.block_bytes;
  map_bytes_ = (used + kHugePage - 1) / kHugePage * kHugePage + kHugePage;
  void* mem = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) throw CapacityErr("cannot reserve " + std::to_string(map_bytes_) + " bytes for the KV pool");
  pool_mem_ = static_cast<uint8_t*>(mem);
  pool_base_ = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(pool_mem_) + kHugePage - 1) & ~(kHugePage - 1));
#ifdef MADV_HUGEPAGE
  madvise(pool_base_, (used + kHugePage - 1) / kHugePage * kHugePage, MADV_HUGEPAGE);  // best effort
#endif
  if (populate) populator_ = std::make_unique<PagePopulator>(pool_base_, pool_bytes);
  free_list_.fill(nblocks_);
  tail_base_ = pool_base_ + pool_bytes;
  tail_free_.fill(ntails_);
  set_threads(num_threads);
}

KVStore::~KVStore() { close(); }

void KVStore::close() {
  std::lock_guard<std::mutex> compute(compute_mu_);
  std::lock_guard<std::mutex> lk(mu_);
  pool_.reset();
  populator_.reset();
  if (pool_mem_) munmap(pool_mem_, map_bytes_);
  pool_mem_ = pool_base_ = tail_base_ = nullptr;
  seqs_.clear();
  free_list_.clear();
  tail_free_.clear();
}

void KVStore::set_threads(int num_threads) {
  if (num_threads < 0) throw ValueErr("num_threads must be >= 0");
  std::lock_guard<std::mutex> compute(compute_mu_);
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  const int n = num_threads == 0 ? ThreadPool::default_threads() : num_threads;
  pool_.reset();
  pool_ = std::make_unique<ThreadPool>(n, openmp_);
  scratch_.assign(n, {});
}

void KVStore::check_open() const {
  if (!pool_base_) throw ValueErr("KV store is closed");
}

void KVStore::check_layer(int layer) const {
  if (layer < 0 || layer >= num_layers_)
    throw ValueErr("layer " + std::to_string(layer) + " out of range [0, " + std::to_string(num_layers_) + ")");
}

const std::vector<KVStore::Seq*>& KVStore::lookup(const int64_t* ids, int n) {
  found_.resize(n);
  const uint64_t stamp = ++lookups_;  // a sequence named twice in this call already holds it
  for (int i = 0; i < n; ++i) {
    auto it = seqs_.find(ids[i]);
    if (it == seqs_.end()) throw KeyErr("unknown sequence id " + id_str(ids[i]));
    if (it->second.seen == stamp) throw ValueErr("sequence id " + id_str(ids[i]) + " appears twice in one call");
    it->second.seen = stamp;
    found_[i] = &it->second;
  }
  return found_;
}

namespace {

// Whether any of x[0..n) has its bits under `mask` all set (fp16: NaN or inf). Branch-free, so
// that the loop vectorizes; the caller raises.
template <typename T>
bool any_masked_all(const T* x, size_t n, T mask) {
  T bad = 0;
  for (size_t i = 0; i < n; ++i) bad |= static_cast<T>((x[i] & mask) == mask);
  return bad != 0;
}

// Whether any of x[0..n) has |x| >= limit or is NaN: compared as bits (|x| orders as its bits, and
// every NaN lies above inf), branch-free.
bool any_at_least(const float* x, size_t n, float limit) {
  uint32_t lim;
  std::memcpy(&lim, &limit, 4);
  const uint32_t* b = reinterpret_cast<const uint32_t*>(x);
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad |= static_cast<uint32_t>((b[i] & 0x7fffffffu) >= lim);
  return bad != 0;
}

// float32 -> bfloat16 bits, rounded to nearest even (finite inputs: the kernel's outputs).
void to_bf16(const float* x, uint16_t* y, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, 4);
    y[i] = static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
  }
}

// Whether any bf16 of x[0..n) lies outside fp16's range (65520 and up rounds to inf) or is NaN:
// |x| from 0x4780 (65536) up, compared as bits, branch-free.
bool any_bf16_beyond_fp16(const uint16_t* x, size_t n) {
  uint16_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad |= static_cast<uint16_t>((x[i] & 0x7fffu) >= 0x4780u);
  return bad != 0;
}

}  // namespace

void KVStore::check_kv_values(Input x, size_t count, const char* name) const {
  const size_t len = x.row_len ? x.row_len : count, rows = len ? count / len : 0;
  for (size_t r = 0; r < rows; ++r) {
    const size_t at = x.offset(r, 0);
    if (x.dtype == DType::f16) {
      if (any_masked_all<uint16_t>(static_cast<const uint16_t*>(x.data) + at, len, 0x7c00u))
        throw ValueErr(std::string(name) + " contains NaN or inf");
    } else if (x.dtype == DType::bf16 ? any_bf16_beyond_fp16(static_cast<const uint16_t*>(x.data) + at, len)
                                      : any_at_least(static_cast<const float*>(x.data) + at, len, 65520.0f)) {
      throw ValueErr(std::string(name) + " contains NaN, inf or a value outside the fp16 range");
    }
  }
}

void KVStore::create(const int64_t* ids, int n) {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  std::unordered_set<int64_t> seen;
  for (int i = 0; i < n; ++i) {
    if (seqs_.count(ids[i])) throw ValueErr("sequence id " + id_str(ids[i]) + " already exists");
    if (!seen.insert(ids[i]).second) throw ValueErr("sequence id " + id_str(ids[i]) + " appears twice in one call");
  }
  for (int i = 0; i < n; ++i) {
    Seq& s = seqs_[ids[i]];
    s.blocks.resize(num_layers_);
    s.len.assign(num_layers_, 0);
    s.tail.assign(num_layers_, -1);
  }
}

void KVStore::free(const int64_t* ids, int n) {
  std::lock_guard<std::mutex> lk(mu_);
  for (int i = 0; i < n; ++i) {
    auto it = seqs_.find(ids[i]);
    if (it == seqs_.end()) continue;
    for (auto& layer_blocks : it->second.blocks)
      for (int32_t b : layer_blocks) deferring_frees_ ? deferred_blocks_.push_back(b) : free_list_.push(b);
    for (int32_t t : it->second.tail)
      if (t >= 0) deferring_frees_ ? deferred_tails_.push_back(t) : tail_free_.push(t);
    seqs_.erase(it);
  }
}

bool KVStore::has(int64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  return seqs_.count(id) > 0;
}

int KVStore::length(int64_t id, int layer) {
  std::lock_guard<std::mutex> lk(mu_);
  check_layer(layer);
  auto it = seqs_.find(id);
  if (it == seqs_.end()) throw KeyErr("unknown sequence id " + id_str(id));
  return it->second.len[layer];
}

std::vector<int32_t> KVStore::block_ids(int64_t id, int layer) {
  std::lock_guard<std::mutex> lk(mu_);
  check_layer(layer);
  auto it = seqs_.find(id);
  if (it == seqs_.end()) throw KeyErr("unknown sequence id " + id_str(id));
  return it->second.blocks[layer];
}

void KVStore::write_token(Seq& s, int layer, int pos, const Input& k, const Input& v, size_t src) {
  write_heads(s.blocks[layer][pos / L_.block_size], pos % L_.block_size, k, v, src, 0, L_.num_kv_heads);
}

void KVStore::write_heads(int32_t block, int slot, const Input& k, const Input& v, size_t src, int h0, int h1) {
  const int D = L_.head_dim, bsp = L_.bsp;
  alignas(64) float kx[4096], vx[4096];
  for (int h = h0; h < h1; ++h) {
    uint8_t* head = pool_base_ + L_.region(block, h);
    if (!L_.int4) {
      write_fp16_head(L_, head, slot, k, v, src, h);
      continue;
    }
    k.floats(k.offset(src, static_cast<size_t>(h) * D), kx, D);
    v.floats(v.offset(src, static_cast<size_t>(h) * D), vx, D);
    const int kg = L_.kgroup, vg = L_.vgroup;
    uint32_t* Kn = reinterpret_cast<uint32_t*>(head + L_.k_off);
    uint16_t* Ks = reinterpret_cast<uint16_t*>(head + L_.ks_off);
    uint16_t* Kz = reinterpret_cast<uint16_t*>(head + L_.kz_off);
    uint8_t* Vn = head + L_.v_off;
    uint16_t* Vs = reinterpret_cast<uint16_t*>(head + L_.vs_off);
    uint16_t* Vz = reinterpret_cast<uint16_t*>(head + L_.vz_off);
    uint8_t u[128], vu[4096 + 32];  // one key group; every value channel, padded to 32 with zeros
    for (int g = 0; g < D / kg; ++g) {
      quantize_group(kx + g * kg, kg, u, &Ks[g * bsp + slot], &Kz[g * bsp + slot]);
      for (int r = 0; r < kg / 8; ++r) {
        const uint8_t* c = u + 8 * r;
        uint32_t w = 0;
        for (int b = 0; b < 4; ++b) w |= static_cast<uint32_t>(c[b] | (c[4 + b] << 4)) << (8 * b);
        Kn[static_cast<size_t>(g * kg / 8 + r) * bsp + slot] = w;
      }
    }
    for (int g = 0; g < D / vg; ++g) quantize_group(vx + g * vg, vg, vu + g * vg, &Vs[g * bsp + slot], &Vz[g * bsp + slot]);
    std::memset(vu + D, 0, 32);
    for (int d = 0; d < D; d += 32)
      for (int i = 0; i < 16; ++i)
        Vn[v_nibble_byte(L_.v_quad, slot, d + i)] = static_cast<uint8_t>(vu[d + i] | (vu[d + 16 + i] << 4));
  }
}

void KVStore::write_tail(Seq& s, int layer, int pos, const Input& k, const Input& v, size_t src) {
  write_tail_heads(s.tail[layer], pos % T_.block_size, k, v, src, 0, T_.num_kv_heads);
}

void KVStore::write_tail_heads(int32_t tail, int slot, const Input& k, const Input& v, size_t src, int h0, int h1) {
  uint8_t* block = tail_base_ + static_cast<size_t>(tail) * T_.block_bytes;
  for (int h = h0; h < h1; ++h)
    write_fp16_head(T_, block + static_cast<size_t>(h) * T_.head_bytes, slot, k, v, src, h);
}

// The lines a write of s's next token at `layer` will touch, where its block exists already (decode
// writes one token per sequence, each to lines last seen a whole step ago: requested a few sequences
// ahead, their misses overlap instead of stalling each write in turn).
void KVStore::prefetch_token(const Seq& s, int layer) const {
  const int pos = s.len[layer], bs = L_.block_size;
  if (pos % bs == 0) return;  // a block still to take from the free list
  prefetch_heads(s.blocks[layer][pos / bs], pos % bs, 0, L_.num_kv_heads);
}

void KVStore::prefetch_heads(int32_t block, int slot, int h0, int h1) const {
  const int D = L_.head_dim;
  const size_t row = static_cast<size_t>(L_.bsp) * 2, rows_per_line = std::max<size_t>(1, 64 / row);
  for (int h = h0; h < h1; ++h) {
    const uint8_t* head = pool_base_ + L_.region(block, h);
    if (L_.int4) {  // a token's nibbles, scales and zeros lie across the whole (small) region
      for (size_t o = 0; o < L_.head_bytes; o += 64) __builtin_prefetch(head + o, 1, 3);
      continue;
    }
    const uint8_t* k = head + L_.k_off + static_cast<size_t>(slot) * 2;
    for (size_t d = 0; d < static_cast<size_t>(D); d += rows_per_line) __builtin_prefetch(k + d * row, 1, 3);
    const uint8_t* v = head + L_.v_off + static_cast<size_t>(slot) * D * 2;
    for (size_t o = 0; o < static_cast<size_t>(D) * 2; o += 64) __builtin_prefetch(v + o, 1, 3);
  }
}

void KVStore::check_room_locked(int layer, const std::vector<Seq*>& seqs, const int64_t* lens) const {
  const int bs = L_.block_size;
  int64_t need = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t cur = seqs[i]->len[layer], add = lens ? lens[i] : 1;
    if (cur + add > std::numeric_limits<int32_t>::max() / 2) throw ValueErr("sequence too long");
    need += (cur + add + bs - 1) / bs - (cur + bs - 1) / bs;
  }
  if (need > static_cast<int64_t>(free_list_.size()))
    throw CapacityErr("out of KV capacity: need " + std::to_string(need) + " blocks, " +
                      std::to_string(free_list_.size()) + " free of " + std::to_string(nblocks_));
}

// The bookkeeping of token pos of s before its write: a new block where it starts one (the caller
// checked there is one), with an fp16 tail while there is room; where it completes a block, that
// block's tail goes back (its int4 copy is read from then on, and the token is not written to it).
void KVStore::begin_token(Seq& s, int layer, int pos) {
  const int bs = L_.block_size;
  int32_t& tail = s.tail[layer];
  if (pos % bs == 0) {
    s.blocks[layer].push_back(free_list_.pop());
    if (bs > 1 && !tail_free_.empty()) tail = tail_free_.pop();
  }
  if (tail >= 0 && (pos + 1) % bs == 0) {
    tail_free_.push(tail);
    tail = -1;
  }
}

// Token pos of s written (src: its row in k, v), after begin_token.
void KVStore::write_at(Seq& s, int layer, int pos, const Input& k, const Input& v, size_t src) {
  write_token(s, layer, pos, k, v, src);
  if (s.tail[layer] >= 0) write_tail(s, layer, pos, k, v, src);
}

void KVStore::append_locked(int layer, const std::vector<Seq*>& seqs, const int64_t* lens, Input k, Input v) {
  check_room_locked(layer, seqs, lens);
  size_t src = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    Seq& s = *seqs[i];
    const int64_t add = lens ? lens[i] : 1;
    if (!lens && i + kWriteAhead < seqs.size()) prefetch_token(*seqs[i + kWriteAhead], layer);
    for (int64_t t = 0; t < add; ++t, ++src) {
      const int pos = s.len[layer];
      begin_token(s, layer, pos);
      write_at(s, layer, pos, k, v, src);
      s.len[layer] = pos + 1;
    }
  }
}

void KVStore::plan_writes_locked(int layer, const std::vector<Seq*>& seqs, Input k, Input v) {
  check_room_locked(layer, seqs, nullptr);
  const size_t n = seqs.size();
  TokenWrites& w = writes_;
  w.block.resize(n);
  w.tail.resize(n);
  w.slot.resize(n);
  w.k = k;
  w.v = v;
  for (size_t i = 0; i < n; ++i) {
    Seq& s = *seqs[i];
    const int pos = s.len[layer];
    begin_token(s, layer, pos);  // in order, as append_locked does
    w.block[i] = s.blocks[layer][pos / L_.block_size];
    w.slot[i] = pos % L_.block_size;
    w.tail[i] = s.tail[layer];
    s.len[layer] = pos + 1;
  }
}

void KVStore::write_head(void* store, int b, int h) {
  KVStore& st = *static_cast<KVStore*>(store);
  const TokenWrites& w = st.writes_;
  st.write_heads(w.block[b], w.slot[b], w.k, w.v, b, h, h + 1);
  if (w.tail[b] >= 0) st.write_tail_heads(w.tail[b], w.slot[b], w.k, w.v, b, h, h + 1);
}

void KVStore::release_deferred_frees() {
  std::lock_guard<std::mutex> lk(mu_);
  deferring_frees_ = false;
  for (int32_t b : deferred_blocks_) free_list_.push(b);
  for (int32_t t : deferred_tails_) tail_free_.push(t);
  deferred_blocks_.clear();
  deferred_tails_.clear();
}

void KVStore::append(int layer, const int64_t* ids, int B, Input k, Input v) {
  append_span(layer, ids, B, nullptr, k, v);
}

// lens == nullptr: one token per sequence (decode).
void KVStore::append_span(int layer, const int64_t* ids, int B, const int64_t* lens, Input k, Input v) {
  int64_t total = lens ? 0 : B;
  for (int i = 0; lens && i < B; ++i) {
    // Checked: a wrapped sum would pass the capacity check and overrun the pool.
    if (lens[i] < 0 || lens[i] > kMaxSpanTokens || __builtin_add_overflow(total, lens[i], &total))
      throw ValueErr("lens must be in [0, " + std::to_string(kMaxSpanTokens) + "] with a sum that fits");
  }
  const size_t count = static_cast<size_t>(total) * L_.num_kv_heads * L_.head_dim;
  check_kv_values(k, count, "k");
  check_kv_values(v, count, "v");
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  check_layer(layer);
  append_locked(layer, lookup(ids, B), lens, k, v);
}

// q * scale * log2(e) into qs_ (the kernels keep scores in log2 units), q checked on the way.
void KVStore::scale_q(Input q, size_t count, float scale) {
  if (qs_.size() < count) qs_.resize(count);
  const float mult = scale * 1.4426950408889634f;
  const size_t len = q.row_len ? q.row_len : count, rows = len ? count / len : 0;
  bool bad = false;
  for (size_t r = 0; r < rows; ++r) {
    float* dst = qs_.data() + r * len;
    const size_t at = q.offset(r, 0);
    if (q.dtype == DType::f16) {
      const uint16_t* p = static_cast<const uint16_t*>(q.data) + at;
      bad |= any_masked_all<uint16_t>(p, len, 0x7c00u);
      to_float(p, dst, len);
      for (size_t i = 0; i < len; ++i) dst[i] *= mult;
    } else if (q.dtype == DType::bf16) {
      const uint16_t* p = static_cast<const uint16_t*>(q.data) + at;
      bad |= any_masked_all<uint16_t>(p, len, 0x7f80u);
      for (size_t i = 0; i < len; ++i) dst[i] = bf2f(p[i]) * mult;
    } else {
      const float* p = static_cast<const float*>(q.data) + at;
      bad |= any_masked_all<uint32_t>(reinterpret_cast<const uint32_t*>(p), len, 0x7f800000u);
      for (size_t i = 0; i < len; ++i) dst[i] = p[i] * mult;
    }
  }
  if (bad) throw ValueErr("q contains NaN or inf");
}

void KVStore::snapshot_locked(int layer, const std::vector<Seq*>& seqs) {
  Snapshot& snap = snap_;
  const int B = static_cast<int>(seqs.size());
  size_t total = 0;
  snap.lens.resize(B);
  for (int b = 0; b < B; ++b) {
    snap.lens[b] = seqs[b]->len[layer];
    if (snap.lens[b] == 0) throw ValueErr("sequence has no KV at layer " + std::to_string(layer));
    total += seqs[b]->blocks[layer].size();
  }
  snap.blocks.resize(total);
  snap.tables.resize(B);
  int32_t* at = snap.blocks.data();
  for (int b = 0; b < B; ++b) {
    const std::vector<int32_t>& table = seqs[b]->blocks[layer];
    std::memcpy(at, table.data(), table.size() * sizeof(int32_t));
    snap.tables[b] = at;
    at += table.size();
  }
  snap.tails.clear();
  if (ntails_ > 0) {
    snap.tails.resize(B);
    for (int b = 0; b < B; ++b) snap.tails[b] = seqs[b]->tail[layer];
  }
}

// Runs without mu_ (other sequences may be appended, created or freed meanwhile)
// but under compute_mu_, which keeps the pool mapped and the thread pool ours.
void KVStore::run_attention(int H, float* out, bool writes, uint16_t* out_bf16) {
  const Snapshot& snap = snap_;
  const int B = static_cast<int>(snap.lens.size()), Hkv = L_.num_kv_heads, G = H / Hkv, D = L_.head_dim;
  if (B == 0) return;
  if (out_bf16) {
    of_.resize(static_cast<size_t>(B) * H * D);
    out = of_.data();
  }

  AttnJob job;
  job.L = &L_;
  job.pool = pool_base_;
  job.H = H;
  job.G = G;
  job.q = qs_.data();
  job.out = out;
  job.tables = snap.tables.data();
  job.lens = snap.lens.data();
  if (!snap.tails.empty()) {
    job.T = &T_;
    job.tail_pool = tail_base_;
    job.tails = snap.tails.data();
  }

  // Items are (sequence, span of kv heads): one item walks its heads block by block, so
  // it reads each block's span as one contiguous run. The span is all heads unless that
  // leaves too few items to share among the threads. Items are cut into chunks of about
  // equal tokens, several per thread, and threads take the next chunk from a shared
  // counter: on a shared machine a descheduled thread then delays only its own chunk.
  int64_t work = 0;
  for (int b = 0; b < B; ++b) work += (static_cast<int64_t>(snap.lens[b]) + 16) * Hkv;
  const int T = work < kParallelMin ? 1 : std::min(pool_->size(), B * Hkv);
  int span = std::min(Hkv, kMaxHeadSpan);
  while (span > 1 && static_cast<int64_t>(B) * ((Hkv + span - 1) / span) < 4 * T) span = (span + 1) / 2;
  const int spans = (Hkv + span - 1) / span, items = B * spans;
  job.head_span = span;
  job.chunk = chunk_blocks(L_, G, T);
  const size_t need = scratch_floats(L_, G, span);
  for (int t = 0; t < T; ++t)
    if (scratch_[t].size() < need) scratch_[t].resize(need);
  // The output of items [begin, end) in bfloat16: sequences' rows lie in item order.
  auto narrow = [&](int begin, int end) {
    if (!out_bf16) return;
    const size_t per_head = static_cast<size_t>(G) * D;
    const size_t from = (static_cast<size_t>(begin / spans) * Hkv + (begin % spans) * span) * per_head;
    const int last = end - 1;
    const size_t to = (static_cast<size_t>(last / spans) * Hkv + std::min(Hkv, (last % spans) * span + span)) *
                      per_head;
    to_bf16(out + from, out_bf16 + from, to - from);
  };
  if (writes) {
    job.write_head = &KVStore::write_head;
    job.write_ctx = this;
  }
  if (T == 1) {
    items_(job, 0, items, scratch_[0].data());
    narrow(0, items);
    return;
  }
  const int nchunks = std::min(items, T * 8);
  std::vector<int>& bounds = bounds_;
  bounds.assign(nchunks + 1, items);
  bounds[0] = 0;
  int64_t acc = 0;
  for (int i = 0, c = 1; i < items && c < nchunks; ++i) {
    const int h0 = (i % spans) * span;
    acc += (static_cast<int64_t>(snap.lens[i / spans]) + 16) * std::min(span, Hkv - h0);
    while (c < nchunks && acc * nchunks >= work * c) bounds[c++] = i + 1;
  }
  std::atomic<int> next{0};
  pool_->run([&](int tid) {
    if (tid >= T) return;
    for (int c = next.fetch_add(1); c < nchunks; c = next.fetch_add(1)) {
      if (bounds[c] >= bounds[c + 1]) continue;
      items_(job, bounds[c], bounds[c + 1], scratch_[tid].data());
      narrow(bounds[c], bounds[c + 1]);
    }
  });
}

void KVStore::attend(int layer, const int64_t* ids, int B, int H, Input q, float scale, float* out,
                     uint16_t* out_bf16) {
  std::lock_guard<std::mutex> compute(compute_mu_);
  scale_q(q, static_cast<size_t>(B) * H * L_.head_dim, scale);
  {
    std::lock_guard<std::mutex> lk(mu_);
    check_open();
    check_layer(layer);
    snapshot_locked(layer, lookup(ids, B));
  }
  run_attention(H, out, false, out_bf16);
}

void KVStore::decode(int layer, const int64_t* ids, int B, int H, Input q, Input k, Input v, float scale,
                     float* out, uint16_t* out_bf16) {
  std::lock_guard<std::mutex> compute(compute_mu_);
  scale_q(q, static_cast<size_t>(B) * H * L_.head_dim, scale);
  const size_t count = static_cast<size_t>(B) * L_.num_kv_heads * L_.head_dim;
  check_kv_values(k, count, "k");
  check_kv_values(v, count, "v");
  {
    std::lock_guard<std::mutex> lk(mu_);
    check_open();
    check_layer(layer);
    const std::vector<Seq*>& seqs = lookup(ids, B);
    plan_writes_locked(layer, seqs, k, v);
    snapshot_locked(layer, seqs);
    deferring_frees_ = true;
  }
  struct Release {
    KVStore* store;
    ~Release() { store->release_deferred_frees(); }
  } release{this};
  run_attention(H, out, true, out_bf16);
}

void KVStore::read(int64_t id, int layer, std::vector<float>* k, std::vector<float>* v) {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  check_layer(layer);
  auto it = seqs_.find(id);
  if (it == seqs_.end()) throw KeyErr("unknown sequence id " + id_str(id));
  const Seq& s = it->second;
  const int n = s.len[layer], D = L_.head_dim, Hkv = L_.num_kv_heads, bs = L_.block_size, bsp = L_.bsp;
  k->assign(static_cast<size_t>(n) * Hkv * D, 0.0f);
  v->assign(static_cast<size_t>(n) * Hkv * D, 0.0f);
  const int tail_from = s.tail[layer] >= 0 ? (n - 1) / bs * bs : n;  // tokens read from the fp16 tail
  for (int t = 0; t < n; ++t) {
    const bool in_tail = t >= tail_from;
    const Layout& L = in_tail ? T_ : L_;
    const uint8_t* base = in_tail ? tail_base_ : pool_base_;
    const int32_t block = in_tail ? s.tail[layer] : s.blocks[layer][t / bs];
    const int slot = t % bs;
    for (int h = 0; h < Hkv; ++h) {
      const uint8_t* head = base + L.region(block, h);
      float* ko = k->data() + (static_cast<size_t>(t) * Hkv + h) * D;
      float* vo = v->data() + (static_cast<size_t>(t) * Hkv + h) * D;
      if (!L.int4) {
        const uint16_t* K = reinterpret_cast<const uint16_t*>(head + L.k_off);
        const uint16_t* V = reinterpret_cast<const uint16_t*>(head + L.v_off) + static_cast<size_t>(slot) * D;
        for (int d = 0; d < D; ++d) {
          ko[d] = h2f(K[static_cast<size_t>(d) * bsp + slot]);
          vo[d] = h2f(V[d]);
        }
        continue;
      }
      const int kg = L_.kgroup, vg = L_.vgroup;
      const uint32_t* Kn = reinterpret_cast<const uint32_t*>(head + L_.k_off);
      const uint16_t* Ks = reinterpret_cast<const uint16_t*>(head + L_.ks_off);
      const uint16_t* Kz = reinterpret_cast<const uint16_t*>(head + L_.kz_off);
      const uint8_t* Vn = head + L_.v_off;
      const uint16_t* Vs = reinterpret_cast<const uint16_t*>(head + L_.vs_off);
      const uint16_t* Vz = reinterpret_cast<const uint16_t*>(head + L_.vz_off);
      for (int d = 0; d < D; ++d) {
        const int gk = d / kg, gv = d / vg;
        const uint32_t kw = Kn[static_cast<size_t>(d / 8) * bsp + slot];
        const int ku = static_cast<int>(kw >> (8 * (d % 4) + 4 * ((d % 8) / 4))) & 15;
        ko[d] = h2f(Ks[gk * bsp + slot]) * ku + h2f(Kz[gk * bsp + slot]);
        const uint8_t vb = Vn[v_nibble_byte(L_.v_quad, slot, d)];
        const int vu = d % 32 < 16 ? vb & 15 : vb >> 4;
        vo[d] = h2f(Vs[gv * bsp + slot]) * vu + h2f(Vz[gv * bsp + slot]);
      }
    }
  }
}

bool KVStore::wait_populated(double timeout_s) {
  std::lock_guard<std::mutex> compute(compute_mu_);  // close() takes it before resetting the populator
  return !populator_ || populator_->wait(timeout_s);
}

StoreStats KVStore::stats() {
  std::lock_guard<std::mutex> lk(mu_);
  StoreStats st{};
  st.sequences = static_cast<int64_t>(seqs_.size());
  for (const auto& kv : seqs_) {  // a sequence's tokens: its longest layer (prefill goes layer by layer)
    int32_t n = 0;
    for (int32_t x : kv.second.len) n = std::max(n, x);
    st.kv_tokens += n;
  }
  st.blocks_total = pool_base_ ? nblocks_ : 0;
  st.blocks_used = st.blocks_total - static_cast<int64_t>(free_list_.size());
  st.bytes_used = st.blocks_used * static_cast<int64_t>(L_.block_bytes);
  st.capacity_bytes = static_cast<int64_t>(capacity_bytes_);
  st.tail_blocks_total = pool_base_ ? ntails_ : 0;
  st.tail_blocks_used = st.tail_blocks_total - static_cast<int64_t>(tail_free_.size());
  st.populated_bytes = populator_ ? static_cast<int64_t>(populator_->populated()) : 0;
  return st;
}

}  // namespace fd
