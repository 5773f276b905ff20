// The KV store of one R-worker: a pool of fixed-size blocks allocated once
// (mmap + MADV_HUGEPAGE), a free list, and per (sequence, layer) block tables.
// All operations take a batch of sequences for one layer; every check runs
// before anything is changed, so a failed call leaves the store as it was.
// Thread-safe: mu_ guards the tables and the free list; attention copies the
// block tables it needs and computes under compute_mu_ only, so appends,
// creates and frees of other sequences proceed meanwhile (attending a sequence
// while freeing it gives that sequence garbage, never a crash).
#pragma once

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "page_populator.h"
#include "thread_pool.h"

namespace fd {

enum class DType { f32, f16, bf16 };

inline float bf2f(uint16_t x) {
  const uint32_t b = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// A borrowed input tensor of `dtype` elements: rows (its first dimension: tokens or sequences) of
// row_len contiguous elements each, `row` elements apart (row_len: contiguous; more: a view of a
// wider buffer, such as q, k and v side by side in the output of one projection).
struct Input {
  const void* data = nullptr;
  DType dtype = DType::f32;
  size_t row = 0, row_len = 0;
  size_t offset(size_t r, size_t c) const { return r * row + c; }  // element c of row r
  // n elements from offset `at` (within one row), as floats.
  void floats(size_t at, float* y, size_t n) const;
  // n elements from offset `at` (within one row), as fp16 bits; a pointer into the data when it is fp16.
  const uint16_t* halves(size_t at, uint16_t* scratch, size_t n) const;
};

struct StoreStats {
  int64_t sequences, kv_tokens, blocks_used, blocks_total, bytes_used, capacity_bytes;
  int64_t tail_blocks_used, tail_blocks_total;  // int4 with fp16 tails: the staging blocks
  int64_t populated_bytes;                       // of the pool, committed ahead by the populator
};

Isa best_isa(const Layout& L);
bool isa_supported(Isa isa, const Layout& L, std::string* why);

constexpr int64_t kMaxSpanTokens = (int64_t{1} << 31) - 1;  // tokens of one sequence in one append_span

// Free block ids, the lowest handed out first (a min-heap). Blocks come back in whatever order
// sequences finish, and the next sequences then still get them from the start of the pool in the
// order they ask: the blocks a decode step starts (one per sequence, in call order) lie side by
// side as in a fresh store, and the kernel reads neighbouring items from neighbouring memory. A
// stack handed a finished batch's blocks back in the reverse order of their frees, each sequence's
// far from the next's: the next batch's attention took 1.17x the time.
class FreeBlocks {
 public:
  void fill(int32_t n) {  // 0 .. n-1: sorted, so already a heap
    ids_.resize(n);
    for (int32_t i = 0; i < n; ++i) ids_[i] = i;
  }
  void push(int32_t id) {
    ids_.push_back(id);
    std::push_heap(ids_.begin(), ids_.end(), std::greater<int32_t>());
  }
  int32_t pop() {  // the caller checked !empty()
    std::pop_heap(ids_.begin(), ids_.end(), std::greater<int32_t>());
    const int32_t id = ids_.back();
    ids_.pop_back();
    return id;
  }
  size_t size() const { return ids_.size(); }
  bool empty() const { return ids_.empty(); }
  void clear() { ids_.clear(); }

 private:
  std::vector<int32_t> ids_;
};

class KVStore {
 public:
  // int4 && fp16_tail: the newest, unfinished block of every (sequence, layer) is also kept in
  // fp16, in a staging area of kTailShare of the capacity, and attention reads it from there
  // (best effort: when the area is full, a new block's tokens are read as int4 only).
  // k_group, v_group: int4 channels per scale and zero of keys / values (valid_group), 0: the default.
  // openmp: attention runs on the process's OpenMP team instead of a pool of its own (ThreadPool).
  // populate: the pool's pages are committed from the start, in the order blocks are handed out,
  // on a thread of their own (PagePopulator); wait_populated() waits for it.
  KVStore(int num_layers, int num_kv_heads, int head_dim, size_t capacity_bytes, int block_size, bool int4,
          int num_threads, Isa isa, bool fp16_tail = false, int k_group = 0, int v_group = 0, bool openmp = false,
          bool populate = false);
  ~KVStore();
  KVStore(const KVStore&) = delete;
  KVStore& operator=(const KVStore&) = delete;

  void create(const int64_t* ids, int n);
  void free(const int64_t* ids, int n);
  bool has(int64_t id);
  int length(int64_t id, int layer);
  std::vector<int32_t> block_ids(int64_t id, int layer);  // where the sequence's blocks are in the pool
  void append(int layer, const int64_t* ids, int B, Input k, Input v);
  void append_span(int layer, const int64_t* ids, int B, const int64_t* lens, Input k, Input v);
  // out: [B, H, D] float32; or, with out_bf16, bfloat16 bits there instead (rounded to nearest even,
  // as torch rounds), and out unused.
  void attend(int layer, const int64_t* ids, int B, int H, Input q, float scale, float* out,
              uint16_t* out_bf16 = nullptr);
  void decode(int layer, const int64_t* ids, int B, int H, Input q, Input k, Input v, float scale, float* out,
              uint16_t* out_bf16 = nullptr);
  // Dequantized (int4) or widened (fp16) cache of one sequence: k, v [len, Hkv, D] fp32.
  void read(int64_t id, int layer, std::vector<float>* k, std::vector<float>* v);
  StoreStats stats();
  // Until the pool is populated (or populating stopped short); false on timeout. Holds attention
  // back meanwhile: for startup.
  bool wait_populated(double timeout_s);
  void set_threads(int num_threads);
  void close();  // frees the pool; later calls raise ValueErr

  const Layout& layout() const { return L_; }
  Isa isa() const { return isa_; }
  int num_layers() const { return num_layers_; }
  int num_threads() const { return pool_ ? pool_->size() : 0; }
  bool openmp() const { return openmp_; }

 private:
  struct Seq {
    std::vector<std::vector<int32_t>> blocks;  // per layer
    std::vector<int32_t> len;                  // per layer
    std::vector<int32_t> tail;                 // per layer: fp16 copy of the newest block, or -1
    uint64_t seen = 0;                         // the last lookup that named it (duplicate check)
  };

  void check_open() const;
  void check_layer(int layer) const;
  const std::vector<Seq*>& lookup(const int64_t* ids, int n);  // KeyErr / ValueErr on duplicates; under mu_
  void check_kv_values(Input x, size_t count, const char* name) const;
  void scale_q(Input q, size_t count, float scale);  // checks q, scaled into qs_; under compute_mu_
  void prefetch_token(const Seq& s, int layer) const;
  void prefetch_heads(int32_t block, int slot, int h0, int h1) const;
  void write_token(Seq& s, int layer, int slot_token, const Input& k, const Input& v, size_t src_token);
  // Heads [h0, h1) of one token (its row src of k, v) into slot `slot` of `block`, and of its fp16 tail.
  void write_heads(int32_t block, int slot, const Input& k, const Input& v, size_t src, int h0, int h1);
  void write_tail_heads(int32_t tail, int slot, const Input& k, const Input& v, size_t src, int h0, int h1);
  // decode's new tokens, one per sequence of the call: their places are taken under mu_ (the lengths
  // already count them), and the attention threads write each head of it just before the kernel
  // reads the block that holds it (AttnJob::write_head): written in a pass of their own ahead of
  // the kernel, the scattered stores of K's column waited on lines the kernel then read again.
  // Until they are written, free() holds back the blocks it returns (deferring_frees_), so that no
  // other sequence can take a block a write is still due to.
  struct TokenWrites {
    std::vector<int32_t> block, tail, slot;  // per sequence of the call; tail -1: none (same slot)
    Input k, v;
  };
  void plan_writes_locked(int layer, const std::vector<Seq*>& seqs, Input k, Input v);  // into writes_
  static void write_head(void* store, int b, int h);  // AttnJob::write_head: one head of writes_
  void release_deferred_frees();
  struct Snapshot {  // what one attention call reads: block ids, lengths and fp16 tails, copied
    std::vector<int32_t> blocks, lens, tails;
    std::vector<const int32_t*> tables;
  };
  void write_tail(Seq& s, int layer, int pos, const Input& k, const Input& v, size_t src);

  void check_room_locked(int layer, const std::vector<Seq*>& seqs, const int64_t* lens) const;
  void begin_token(Seq& s, int layer, int pos);
  void write_at(Seq& s, int layer, int pos, const Input& k, const Input& v, size_t src);
  void append_locked(int layer, const std::vector<Seq*>& seqs, const int64_t* lens, Input k, Input v);
  void snapshot_locked(int layer, const std::vector<Seq*>& seqs);  // into snap_
  // over snap_ with q from qs_ (and writes_)
  void run_attention(int H, float* out, bool writes = false, uint16_t* out_bf16 = nullptr);

  Layout L_;
  int num_layers_;
  Isa isa_;
  ItemsFn items_;
  uint8_t* pool_mem_ = nullptr;
  size_t map_bytes_ = 0;
  uint8_t* pool_base_ = nullptr;
  size_t capacity_bytes_;
  int32_t nblocks_;
  FreeBlocks free_list_;
  std::unique_ptr<PagePopulator> populator_;
  Layout T_;                          // fp16 tails: same shape as L_, fp16 format
  uint8_t* tail_base_ = nullptr;      // inside the same mapping, after the block pool
  int32_t ntails_ = 0;
  FreeBlocks tail_free_;
  std::unordered_map<int64_t, Seq> seqs_;
  std::unique_ptr<ThreadPool> pool_;
  bool openmp_ = false;
  std::vector<std::vector<float>> scratch_;
  // Per-call buffers, kept to spare each call its allocations (and the page faults of fresh memory).
  std::vector<Seq*> found_;   // lookup's result; under mu_
  uint64_t lookups_ = 0;      // under mu_
  Snapshot snap_;             // under compute_mu_
  std::vector<float> qs_;     // under compute_mu_
  std::vector<int> bounds_;   // under compute_mu_
  TokenWrites writes_;        // under compute_mu_
  std::vector<float> of_;     // under compute_mu_: the float32 output, where the caller takes bfloat16
  bool deferring_frees_ = false;                           // under mu_
  std::vector<int32_t> deferred_blocks_, deferred_tails_;  // under mu_
  std::mutex compute_mu_;  // taken before mu_ when both are needed
  std::mutex mu_;
};

}  // namespace fd
