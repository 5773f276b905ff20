// Shared by every translation unit of the kernel: the block layout, the job
// description the attention kernels consume, fp16 conversion and error types.
//
// This header is always included BEFORE any `#pragma GCC target` region, so
// everything defined here is compiled for the baseline ISA only.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace fd {

enum class Isa { scalar = 0, avx2 = 1, avx512 = 2, avx512vnni = 3 };

// Thrown by the store; the bindings map them to KeyError / ValueError / KVCapacityError.
struct KeyErr : std::runtime_error { using std::runtime_error::runtime_error; };
struct ValueErr : std::runtime_error { using std::runtime_error::runtime_error; };
struct CapacityErr : std::runtime_error { using std::runtime_error::runtime_error; };

// IEEE fp16 <-> fp32, round to nearest even (portable; the hot paths use F16C).
inline uint16_t f2h(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint16_t o;
  if (x >= 0x47800000u) {  // >= 65536, inf or nan
    o = x > 0x7f800000u ? 0x7e00 : 0x7c00;
  } else if (x < 0x38800000u) {  // < 2^-14: subnormal or zero; let the FPU round
    float fx;
    std::memcpy(&fx, &x, 4);
    fx += 0.5f;
    uint32_t r;
    std::memcpy(&r, &fx, 4);
    o = static_cast<uint16_t>(r - 0x3f000000u);
  } else {
    const uint32_t odd = (x >> 13) & 1u;
    x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + odd;
    o = static_cast<uint16_t>(x >> 13);
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

inline float h2f(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  uint32_t r;
  if (em >= 0x7c00u) {
    r = sign | 0x7f800000u | ((em & 0x3ffu) << 13);
  } else if (em >= 0x0400u) {
    r = sign | ((em << 13) + (static_cast<uint32_t>(127 - 15) << 23));
  } else {
    const float f = static_cast<float>(em) * 5.9604644775390625e-08f;  // em * 2^-24
    std::memcpy(&r, &f, 4);
    r |= sign;
  }
  float f;
  std::memcpy(&f, &r, 4);
  return f;
}

// One block holds `block_size` tokens of one (sequence, layer), all kv heads.
// Inside it, each kv head owns one contiguous region (head_bytes), K then V, and
// the regions lie side by side: a work item (sequence, span of kv heads) reads
// its span of each block as one contiguous run (per-head items striding across
// blocks read 0.65 of STREAM bandwidth on one Zen 5 thread, span items 0.82).
// An int4 chunk (chunk_blocks: 2 or 4 blocks of one head) reads that many such runs at once: 4
// read 0.82-0.86 of STREAM at 2 threads. Storing a chunk's blocks head-major, as one run, read
// 0.88-0.96 when a prefill had filled them, but 0.67 (against 0.82) for blocks taken in turn by
// growing sequences, whose regions it strided: that needs an allocator that gives a sequence
// whole groups.
//
//   fp16:  K [D][bsp] (transposed: a row is one channel of bsp tokens)
//          V [bs][D]
//   int4:  K nibbles [D/8][bsp] u32: word t of row r = channels 8r..8r+7 of token t; its byte b
//                                  holds channel 8r+b (low nibble) and 8r+4+b (high nibble)
//          K scale, zero [D/kg][bsp] fp16     (one group = kg channels of one token)
//          V nibbles [bsp/4][Dp/32][64] u8: tokens in quads; line l of quad g holds channels
//                                  32l..32l+31 of tokens 4g..4g+3, its byte 4i + t channel 32l+i of
//                                  token 4g+t (low nibble) and channel 32l+16+i (high nibble);
//                                  Dp = D rounded up to 32 (padding channels hold 0)
//          V scale, zero [D/vg][bsp] fp16     (vg channels of one token)
//
// bsp = block_size rounded up to 16, so full-vector loads across tokens stay
// inside the region; lanes past the last token are ignored by the kernels.
// The V nibbles of 4 tokens of one channel share a 32-bit lane: a 64-byte line gives 16 channels'
// nibbles by one `and` (or a shift and an `and`) per token, and 4 tokens of 16 channels as the bytes
// of one integer dot product (avx512vnni).
//
// int4 groups (kg for keys, vg for values): 16, 32, 64 or 128 channels dividing D. Larger
// groups store fewer scale and zero bytes (at D = 128 a token of one kv head takes 160 bytes at
// 32/32, 152 at 32/64, 144 at 64/64) but round more coarsely. Keys suffer more than values
// (bench/results/int4_grouping.json: default model, perplexity over fp16 KV +3.3% at 32/32, +4.2%
// at 32/64, +7.8% at 64/32), so the defaults are 32 for keys and 64 for values, or the largest
// group below that divides D.
constexpr int kDefaultKGroup = 32, kDefaultVGroup = 64;

inline bool valid_group(int group, int head_dim) {
  return (group == 16 || group == 32 || group == 64 || group == 128) && head_dim % group == 0;
}

inline int default_group(int most, int head_dim) {
  int g = most;
  while (g > 16 && head_dim % g) g /= 2;
  return g;
}

// int4 V: the byte holding channel d of token slot (low nibble if d % 32 < 16, else high).
inline size_t v_nibble_byte(size_t v_quad, int slot, int d) {
  return static_cast<size_t>(slot / 4) * v_quad + static_cast<size_t>(d / 32) * 64 + 4 * (d % 16) + slot % 4;
}

struct Layout {
  int num_kv_heads = 0, head_dim = 0, block_size = 0, bsp = 0, kgroup = 0, vgroup = 0;
  bool int4 = false;
  size_t k_off = 0, ks_off = 0, kz_off = 0, v_off = 0, vs_off = 0, vz_off = 0;
  size_t v_quad = 0;  // int4: bytes of V nibbles per quad of tokens (Dp / 32 lines of 64)
  size_t head_bytes = 0, block_bytes = 0;

  // kgroup, vgroup: int4 only, valid_group or 0 (checked by the store)
  static Layout make(int num_kv_heads, int head_dim, int block_size, bool int4, int kgroup = 0, int vgroup = 0) {
    Layout L;
    L.num_kv_heads = num_kv_heads;
    L.head_dim = head_dim;
    L.block_size = block_size;
    L.bsp = (block_size + 15) / 16 * 16;
    L.int4 = int4;
    const size_t D = head_dim, bs = block_size, bsp = L.bsp;
    auto a64 = [](size_t x) { return (x + 63) / 64 * 64; };
    if (!int4) {
      L.k_off = 0;
      L.v_off = a64(D * bsp * 2);
      L.head_bytes = a64(L.v_off + bs * D * 2);
    } else {
      L.kgroup = kgroup ? kgroup : default_group(kDefaultKGroup, head_dim);
      L.vgroup = vgroup ? vgroup : default_group(kDefaultVGroup, head_dim);
      const size_t nkg = D / L.kgroup, nvg = D / L.vgroup;
      L.k_off = 0;
      L.ks_off = a64(D / 2 * bsp);
      L.kz_off = L.ks_off + nkg * bsp * 2;
      L.v_off = a64(L.kz_off + nkg * bsp * 2);
      L.v_quad = (D + 31) / 32 * 64;
      L.vs_off = a64(L.v_off + bsp / 4 * L.v_quad);
      L.vz_off = L.vs_off + nvg * bsp * 2;
      L.head_bytes = a64(L.vz_off + nvg * bsp * 2);
    }
    L.block_bytes = L.head_bytes * num_kv_heads;
    return L;
  }

  // Offset in the pool of the region (block, kv head).
  size_t region(int32_t block, int head) const {
    return static_cast<size_t>(block) * block_bytes + static_cast<size_t>(head) * head_bytes;
  }
};

// Most kv heads one work item walks together (see run_items).
constexpr int kMaxHeadSpan = 64;

// Blocks per chunk: the blocks of one kv head whose scores share one softmax update (see
// run_items). An int4 region (block, kv head) is small (2.5 KiB at D=128 and 16 tokens), and its
// per-chunk work (softmax, the P V weights in fixed point) weighs: 2 blocks take 1.29x the
// arithmetic of 4 (in cache). But a chunk reads its regions at once, one block apart, and where
// the call is bound by memory, 2 at a time read faster: MHA on 2 threads (7B shape, from DRAM,
// the machine's bandwidth shared) took 0.85-0.96x the time of 4 blocks in 5 runs of 6 (1.17x in
// one with the bandwidth to itself), while with 2 blocks 1 thread took 1.16-1.24x and GQA (4
// query heads sharing each block's loads) 1.13-1.28x. fp16 is bound by memory, and reading its
// regions in chunk order defeats its prefetch (one region ahead): it keeps 1.
constexpr int kChunkBlocksInt4 = 4, kChunkBlocksFp16 = 1;

// Blocks per chunk for a call on `threads` threads with G query heads per kv head (see above).
inline int chunk_blocks(const Layout& L, int G, int threads) {
  if (!L.int4) return kChunkBlocksFp16;
  return G == 1 && threads > 1 ? 2 : kChunkBlocksInt4;
}

// One attention call over a batch, as the kernels see it. Work item i is (sequence
// i / spans, kv heads [h0, h0 + head_span)), spans = ceil(num_kv_heads / head_span),
// h0 = (i % spans) * head_span.
struct AttnJob {
  const Layout* L = nullptr;
  const uint8_t* pool = nullptr;
  int H = 0, G = 0;                        // query heads; query heads per kv head
  int head_span = 1;                       // kv heads per item, 1..kMaxHeadSpan
  int chunk = 1;                           // blocks per chunk (chunk_blocks)
  const float* q = nullptr;                // [B, H, D], already multiplied by scale * log2(e)
  float* out = nullptr;                    // [B, H, D]
  const int32_t* const* tables = nullptr;  // [B] -> block ids of the sequence at this layer
  const int32_t* lens = nullptr;           // [B] tokens in the cache
  // int4 with fp16 tails: tails[b] >= 0 is the fp16 copy (layout *T, pool tail_pool) of the last
  // block of sequence b, read instead of its int4 block; nullptr or -1: none.
  const Layout* T = nullptr;
  const uint8_t* tail_pool = nullptr;
  const int32_t* tails = nullptr;
  // Decode: write_head(write_ctx, b, h) stores sequence b's new token at kv head h; the kernel calls
  // it just before the chunk that holds that token.
  void (*write_head)(void* ctx, int b, int h) = nullptr;
  void* write_ctx = nullptr;
};

// Floats of scratch one thread needs for items of this shape (see run_items): per-block
// temporaries shared by the item's heads, and the running state of each head.
inline size_t scratch_floats(const Layout& L, int G, int head_span) {
  const size_t D = L.head_dim, bsp = L.bsp, rows = size_t(G) * head_span;
  const size_t nkg = L.int4 ? D / L.kgroup : 0, nvg = L.int4 ? D / L.vgroup : 0;
  // m, l, qsum, acc, zacc, fs, limbs per row; P (a chunk of blocks), Cc, fc and Cq for a tile of
  // 8 rows; 64-byte alignment of 12 arrays
  const size_t chunk = L.int4 ? kChunkBlocksInt4 : kChunkBlocksFp16;
  return rows * (1 + 16 + nkg + D + nvg * 16 + nkg + 3 * (D / 4)) + 8 * chunk * bsp + 8 * nvg * bsp + 8 * nvg +
         8 * nvg * chunk * bsp + 16 * 12;
}

using ItemsFn = void (*)(const AttnJob&, int begin, int end, float* scratch);

// Per-ISA kernels; nullptr when not compiled for this target.
ItemsFn scalar_items();
ItemsFn avx2_items();
ItemsFn avx512_items();
ItemsFn avx512vnni_items();

}  // namespace fd
