// Decode attention over the paged KV store, written once over a small vector
// trait `V` (W lanes of fp32) and instantiated per ISA by attention_<isa>.cpp.
//
// Included INSIDE a per-ISA namespace after `V` is defined; it must include
// nothing itself (every instantiation here is compiled for that ISA only).
//
// Reference (what every path computes, per sequence b and query head j, with
// kv head h = j / G and the cache K, V of h):
//     s_t = (q_j . K_t) / sqrt(D);   o_j = sum_t softmax(s)_t V_t
// in one pass over the blocks with an online softmax (running max m, running
// sum l, accumulator acc rescaled by 2^(m_old - m_new)); scores are kept in
// log2 units (q is pre-multiplied by log2(e) / sqrt(D)). All math in fp32, except
// that with FD_VNNI (the avx512vnni path) int4 key scores are integer dot products
// of the nibbles with q in 24-bit fixed point (q_limbs), and int4 value sums integer
// dot products of the nibbles with each chunk's weights in 24-bit fixed point
// (pv_int4_vnni_chunk), both summed exactly in int32.
// The plain float64 version is `reference_attention` in rpart/kernels.py.
//
// int4: a stored value is x = scale * u + zero (u in 0..15, per group of channels
// of one token: kg for keys, vg for values). The kernels never materialise x:
//     q . k   = sum_groups  scale_g * (q . u)_g + zero_g * sum_g(q)
//     sum_t p_t v_t = sum_t (p_t * scale_t) u_t  +  sum_t p_t * zero_t   (per group)

typedef V::F F;
constexpr int W = V::W;

// Software prefetch of a later block's head region, spread over the loops of this block
// (a burst of 100+ prefetches would stall on fill buffers). V::prefetch asks for the line in L2
// (the T2 hint), not L1: each L1 prefetch holds one of the core's few L1 miss buffers until its
// line arrives from DRAM, and the kernel then reads too little at once. Growing sequences at
// batch 512, context 17-128 on 2 threads (Zen 4), T2 against T0: fp16 0.74-0.78x the time,
// int4 0.92x, the AVX2 path 0.80-0.86x; at 1 thread fp16 0.78x; in cache the same.
struct Prefetch {
  const uint8_t* cur = nullptr;  // next line to prefetch; nullptr: nothing to do
  const uint8_t* end = nullptr;
  int per_step = 0;              // lines per step()
  inline void step() {
    for (int i = 0; i < per_step && cur < end; ++i, cur += 64) V::prefetch(cur);
  }
};

// Bytes ahead the kernel prefetches, in the order it reads (RegionWalk). A region is 8 KiB
// at fp16 and 2.5 KiB at int4 (D=128); int4 regions are small, so their successors must be
// requested earlier, by a distance that grows with the chunk (kPrefetchBytesInt4 per block of
// it). Measured (Zen 5): fp16 best at 4-8 KiB ahead (16 KiB and more is slower at 1 and 2
// threads); int4 chunks of 4 blocks at 6 / 8 / 12 / 32 KiB 1.28-1.33x / 1.08-1.13x / 0.99-1.01x /
// 1.03x the time of 16 KiB, at 1 and 2 threads; chunks of 2 (2 threads) at 12 / 16 / 24 KiB
// 1.03x / 1.04x / 1.11x the time of 8 KiB.
constexpr size_t kPrefetchBytesFp16 = 8192, kPrefetchBytesInt4 = 4096;

// The regions of an item in read order (chunks of NB blocks; inside a chunk, head by head,
// and each head's blocks in turn), walked pf_regions ahead of the kernel for its software
// prefetch: next() is the region to prefetch while the kernel does the P V of the current one.
// A walk made by `items` goes on from an item's last region to the next item's first, up to item
// `end`, so that at short contexts (a few regions per item) an item's first regions are requested
// during the previous one instead of missing when the kernel reaches them.
struct RegionWalk {
  const Layout* L;
  const Layout* T;  // fp16 tails (AttnJob::T)
  const uint8_t* pool;
  const int32_t* table;
  int h0, nh, nblk, NB;
  int i0 = 0, j = 0, c = 0;  // the cursor: chunk start, head, block in chunk
  const AttnJob* job = nullptr;  // set by items(): the walk crosses into later items
  int item = 0, end = 0;

  // The walk of item i of J (regions of that item only).
  static RegionWalk of(const AttnJob& J, int i) {
    const int Hkv = J.L->num_kv_heads, span = J.head_span, spans = (Hkv + span - 1) / span;
    const int b = i / spans, h0 = (i % spans) * span;
    return RegionWalk{J.L, J.T, J.pool, J.tables[b], h0, Hkv - h0 < span ? Hkv - h0 : span,
                      (J.lens[b] + J.L->block_size - 1) / J.L->block_size, J.chunk};
  }
  // The walk of items [i, end) of J, as one.
  static RegionWalk items(const AttnJob& J, int i, int end) {
    RegionWalk w = of(J, i);
    w.job = &J;
    w.item = i;
    w.end = end;
    return w;
  }
  const uint8_t* at(int blk, int head) const {
    return pool + L->region(table[blk], h0 + head);
  }
  __attribute__((always_inline)) inline void advance() {
    const int nb = nblk - i0 < NB ? nblk - i0 : NB;
    if (++c < nb) return;
    c = 0;
    if (++j < nh) return;
    j = 0;
    i0 += NB;
    if (i0 >= nblk && job && item + 1 < end) *this = items(*job, item + 1, end);
  }
  __attribute__((always_inline)) inline Prefetch next(int lines_per_token) {
    Prefetch pf;
    if (i0 < nblk) {
      pf.cur = at(i0 + c, j);
      pf.end = pf.cur + L->head_bytes;
      pf.per_step = lines_per_token;
      advance();
    }
    return pf;
  }
};

// Software prefetch of `regions` regions of a walk in turn, per_step lines per step(). The int4
// chunks of the integer path spread it over their scores and their P V: issued in that short P V
// alone, the requests came in bursts, and the kernel ran 17% slower from DRAM than before it.
struct PrefetchRun {
  RegionWalk* w = nullptr;
  const uint8_t *cur = nullptr, *end = nullptr;
  int regions = 0, per_step = 0;
  // per_step lines for each of n steps, at once (called between the hot loops: stepped inside them,
  // it took their registers and the kernel lost a third of its speed).
  inline void step(int n = 1) {
    for (int i = 0; i < n * per_step; ++i, cur += 64) {
      if (cur >= end) {
        const Prefetch p = regions > 0 ? w->next(0) : Prefetch();
        regions = p.cur ? regions - 1 : 0;
        cur = p.cur;
        end = p.end;
        if (!cur) return;
      }
      V::prefetch(cur);
    }
  }
};

// Independent FMA chains per head, so that GT heads together keep >= 8 in flight.
template <int GT>
constexpr int qk_chains() {
  constexpr int want = (8 + GT - 1) / GT;
  constexpr int fit = (V::kRegs - 4) / GT;  // registers left for accumulators
  return want < fit ? want : (fit > 0 ? fit : 1);
}

// QK for GT query heads against up to one block of fp16 keys: P[g][t] = q_g . k_t
// Aligned to 64 bytes: where its loop fell by chance, a change elsewhere that moved all code by
// 32 bytes made the fp16 kernel 1.03-1.13x slower from DRAM with a neighbour holding bandwidth
// (same-process A/B, Zen 5); at this alignment it ran as the fast placement did with the rest of
// the code moved by 0 and by 32 bytes. Other functions' placement still counts: also aligning
// pv_fp16_chunk gave one placement 1.09-1.12x slower and another as fast.
template <int GT>
__attribute__((aligned(64)))
static void scores_fp16(const Layout& L, const uint8_t* head, int n, const float* q, float* P, int ps,
                        Prefetch& pf_io) {
  Prefetch pf = pf_io;
  constexpr int C = qk_chains<GT>();
  const int D = L.head_dim, bsp = L.bsp;
  const uint16_t* K = reinterpret_cast<const uint16_t*>(head + L.k_off);
  const ptrdiff_t rs = bsp;  // one row: one channel of bsp tokens
  for (int c0 = 0; c0 < n; c0 += W) {
    F s[GT][C];
    for (int g = 0; g < GT; ++g)
      for (int j = 0; j < C; ++j) s[g][j] = V::zero();
    const uint16_t* kp = K + c0;
    const float* qd = q;  // q + g * D + d, bumped with d (no index arithmetic per FMA)
    int d = 0;
    for (; d + C <= D; d += C, kp += C * rs, qd += C) {
      pf.step();
      for (int j = 0; j < C; ++j) {
        const F k = V::load_h(kp + j * rs);
        for (int g = 0; g < GT; ++g) s[g][j] = V::fma(V::set1(qd[g * D + j]), k, s[g][j]);
      }
    }
    for (; d < D; ++d, kp += rs, ++qd) {
      const F k = V::load_h(kp);
      for (int g = 0; g < GT; ++g) s[g][0] = V::fma(V::set1(qd[g * D]), k, s[g][0]);
    }
    for (int g = 0; g < GT; ++g) {
      F t = s[g][0];
      for (int j = 1; j < C; ++j) t = V::add(t, s[g][j]);
      V::store(P + g * ps + c0, t);
    }
  }
  pf_io = pf;
}

// The 8 channels of one int4 key row, as floats for W tokens: dword t of the row holds
// channels 8r + b (low nibble of byte b) and 8r + 4 + b (high nibble), b = 0..3.
template <int C>
static inline F key_nib(typename V::I x) {
  return V::template nib_at<C < 4 ? 8 * C : 8 * (C - 4) + 4>(x);
}

template <int GT, int CH, int C>
static inline void key_fma(typename V::I x, const float* const* qd, int ch0, F (&r)[GT][CH]) {
  const F k = key_nib<C>(x);
  for (int g = 0; g < GT; ++g) r[g][C % CH] = V::fma(V::set1(qd[g][ch0 + C]), k, r[g][C % CH]);
}

// QK for int4 keys in fp32. qsum[g * ng + grp] = sum of q_g over the channels of group grp.
template <int GT>
static void scores_int4(const Layout& L, const uint8_t* head, int n, const float* q, const float* qsum,
                        float* P, int ps) {
  constexpr int CH = GT == 1 ? 8 : (GT == 2 ? 4 : (GT <= 4 ? 2 : 1));  // FMA chains per head
  const int D = L.head_dim, bsp = L.bsp, qg = L.kgroup, ng = D / qg;
  const uint32_t* Kn = reinterpret_cast<const uint32_t*>(head + L.k_off);
  const uint16_t* Ks = reinterpret_cast<const uint16_t*>(head + L.ks_off);
  const uint16_t* Kz = reinterpret_cast<const uint16_t*>(head + L.kz_off);
  for (int c0 = 0; c0 < n; c0 += W) {
    F s[GT];
    for (int g = 0; g < GT; ++g) s[g] = V::zero();
    for (int grp = 0; grp < ng; ++grp) {
      F r[GT][CH];
      for (int g = 0; g < GT; ++g)
        for (int j = 0; j < CH; ++j) r[g][j] = V::zero();
      const float* qd[GT];
      for (int g = 0; g < GT; ++g) qd[g] = q + g * D + grp * qg;
      for (int rr = 0; rr < qg / 8; ++rr) {
        const typename V::I x = V::load_u32(Kn + static_cast<ptrdiff_t>(grp * qg / 8 + rr) * bsp + c0);
        key_fma<GT, CH, 0>(x, qd, 8 * rr, r); key_fma<GT, CH, 1>(x, qd, 8 * rr, r);
        key_fma<GT, CH, 2>(x, qd, 8 * rr, r); key_fma<GT, CH, 3>(x, qd, 8 * rr, r);
        key_fma<GT, CH, 4>(x, qd, 8 * rr, r); key_fma<GT, CH, 5>(x, qd, 8 * rr, r);
        key_fma<GT, CH, 6>(x, qd, 8 * rr, r); key_fma<GT, CH, 7>(x, qd, 8 * rr, r);
      }
      const F ks = V::load_h(Ks + static_cast<size_t>(grp) * bsp + c0);
      const F kz = V::load_h(Kz + static_cast<size_t>(grp) * bsp + c0);
      for (int g = 0; g < GT; ++g) {
        F dot = r[g][0];
        for (int j = 1; j < CH; ++j) dot = V::add(dot, r[g][j]);
        s[g] = V::fma(ks, dot, s[g]);
        s[g] = V::fma(kz, V::set1(qsum[g * ng + grp]), s[g]);
      }
    }
    for (int g = 0; g < GT; ++g) V::store(P + g * ps + c0, s[g]);
  }
}

#ifdef FD_VNNI
// q in fixed point for the integer path: per query head and key group (kg channels),
// q_d ~= fs * (a_d * 2^16 + b_d * 2^8 + c_d), a, b, c signed bytes, |q_d - that| <= fs / 2
// with fs = max_d |q_d| / (2^23 - 2^16): the error of rounding the group's largest |q| to fp32.
// limbs[(g * 3 + limb) * D/4 + i] packs the limb of channels 4i..4i+3, one byte each.
template <int KG>
static void q_limbs(const float* q, int G, int D, int kg_rt, int32_t* limbs, float* fs) {
  const int kg = KG ? KG : kg_rt, ng = D / kg;
  for (int g = 0; g < G; ++g) {
    int8_t* la = reinterpret_cast<int8_t*>(limbs + (g * 3 + 0) * (D / 4));
    int8_t* lb = reinterpret_cast<int8_t*>(limbs + (g * 3 + 1) * (D / 4));
    int8_t* lc = reinterpret_cast<int8_t*>(limbs + (g * 3 + 2) * (D / 4));
    for (int grp = 0; grp < ng; ++grp) {
      const float* x = q + g * D + grp * kg;
      __m512 m = _mm512_setzero_ps();
      for (int d = 0; d < kg; d += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + d)));
      const float mx = _mm512_reduce_max_ps(m);
      float f = mx / 8323072.0f;
      if (!(f >= 1.17549435e-38f)) f = mx > 0.0f ? 1.17549435e-38f : 1.0f;  // subnormal or zero q
      fs[g * ng + grp] = f;
      const __m512 inv = _mm512_set1_ps(1.0f / f);
      const __m512i k128 = _mm512_set1_epi32(128), k255 = _mm512_set1_epi32(255);
      auto low_byte = [&](__m512i v) {  // v's signed low byte: ((v + 128) & 255) - 128
        return _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, k128), k255), k128);
      };
      for (int d = 0; d < kg; d += 16) {  // kg is a multiple of 16 (valid_group)
        const __m512i Q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + d), inv));  // nearest, ties even
        const __m512i c = low_byte(Q), q1 = _mm512_srai_epi32(_mm512_sub_epi32(Q, c), 8);  // exact: Q - c = 256 k
        const __m512i b = low_byte(q1), a = _mm512_srai_epi32(_mm512_sub_epi32(q1, b), 8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(la + grp * kg + d), _mm512_cvtepi32_epi8(a));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lb + grp * kg + d), _mm512_cvtepi32_epi8(b));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lc + grp * kg + d), _mm512_cvtepi32_epi8(c));
      }
    }
  }
}

// QK for int4 keys with integer dot products (u8 nibbles x s8 limbs, 4 channels per lane
// and instruction), three limbs summed exactly in int32, combined in fp32 once per group.
// KG: the key group when fixed at compile time, else 0 (L.kgroup).
template <int GT, int KG>
static void scores_int4_vnni(const Layout& L, const uint8_t* head, int n, const int32_t* limbs, const float* fs,
                             const float* qsum, float* P, int ps) {
  constexpr int CH = GT <= 2 ? 2 : 1;  // accumulators per (head, limb): low and high nibbles apart
  const int D = L.head_dim, bsp = L.bsp, kr = (KG ? KG : L.kgroup) / 8, ng = D / (8 * kr), D4 = D / 4;
  const uint32_t* Kn = reinterpret_cast<const uint32_t*>(head + L.k_off);
  const uint16_t* Ks = reinterpret_cast<const uint16_t*>(head + L.ks_off);
  const uint16_t* Kz = reinterpret_cast<const uint16_t*>(head + L.kz_off);
  for (int c0 = 0; c0 < n; c0 += W) {
    F s[GT][2], z[GT];  // two chains for the scale terms (even / odd groups), one for the zero terms
    for (int g = 0; g < GT; ++g) s[g][0] = s[g][1] = z[g] = V::zero();
    for (int grp = 0; grp < ng; ++grp) {
      typename V::I a[GT][3][CH];
      for (int g = 0; g < GT; ++g)
        for (int l = 0; l < 3; ++l)
          for (int j = 0; j < CH; ++j) a[g][l][j] = V::izero();
#pragma GCC unroll 8
      for (int rr = 0; rr < kr; ++rr) {
        const int r = grp * kr + rr;
        typename V::I lo, hi;
        V::nib_bytes(V::load_u32(Kn + static_cast<ptrdiff_t>(r) * bsp + c0), lo, hi);
        for (int g = 0; g < GT; ++g)
          for (int l = 0; l < 3; ++l) {
            const int32_t* w = limbs + (g * 3 + l) * D4 + 2 * r;
            a[g][l][0] = V::dpbusd(a[g][l][0], lo, w);
            a[g][l][CH - 1] = V::dpbusd(a[g][l][CH - 1], hi, w + 1);
          }
      }
      const F ks = V::load_h(Ks + static_cast<size_t>(grp) * bsp + c0);
      const F kz = V::load_h(Kz + static_cast<size_t>(grp) * bsp + c0);
      for (int g = 0; g < GT; ++g) {
        typename V::I A = a[g][0][0], B = a[g][1][0], C = a[g][2][0];
        if (CH == 2) {
          A = V::iadd(A, a[g][0][CH - 1]);
          B = V::iadd(B, a[g][1][CH - 1]);
          C = V::iadd(C, a[g][2][CH - 1]);
        }
        // kg <= 32: |C| < 2^16 and |B| * 2^8 < 2^24, the inner sum is exact; one rounding in the outer.
        const F dot = V::fma(V::cvt(A), V::set1(65536.0f), V::fma(V::cvt(B), V::set1(256.0f), V::cvt(C)));
        s[g][grp & 1] = V::fma(ks, V::mul(dot, V::set1(fs[g * ng + grp])), s[g][grp & 1]);
        z[g] = V::fma(kz, V::set1(qsum[g * ng + grp]), z[g]);
      }
    }
    for (int g = 0; g < GT; ++g) V::store(P + g * ps + c0, V::add(V::add(s[g][0], s[g][1]), z[g]));
  }
}

// scores_int4_vnni for GT rows and U column units at once (W tokens of a block each, from up to U
// blocks): each limb is broadcast into a register once per key row and serves all U units. (As
// memory operands of every instruction, the limb loads bounded the loop: 6 per 8 channels and row.)
// Unit u: key rows from kn[u], scales and zero points from ks[u], kz[u], scores of row g to
// out[u] + g * ps. Row g's limbs, steps and sums at limbs + g * 3 * D/4, fs + g * nkg, qsum + g * nkg.
template <int GT, int U, int KG>
static void scores_int4_vnni_units(const Layout& L, const uint32_t* const* kn, const uint16_t* const* ks,
                                   const uint16_t* const* kz, float* const* out, int ps, const int32_t* limbs,
                                   const float* fs, const float* qsum, PrefetchRun& pf_io) {
  typedef typename V::I I;
  PrefetchRun pf = pf_io;  // a local copy stays in registers
  const int D = L.head_dim, bsp = L.bsp, kr = (KG ? KG : L.kgroup) / 8, ng = D / (8 * kr), D4 = D / 4;
  F s[U];  // GT == 1; more rows add up in out (GT 4 x 2 units: 24 accumulators in registers already)
  for (int u = 0; u < U; ++u) s[u] = V::zero();
  if (GT > 1)
    for (int g = 0; g < GT; ++g)
      for (int u = 0; u < U; ++u) V::store(out[u] + g * ps, V::zero());
  for (int grp = 0; grp < ng; ++grp) {
    pf.step(kr);
    I a[GT][U][3];
    for (int g = 0; g < GT; ++g)
      for (int u = 0; u < U; ++u) a[g][u][0] = a[g][u][1] = a[g][u][2] = V::izero();
#pragma GCC unroll 8
    for (int rr = 0; rr < kr; ++rr) {
      const int r = grp * kr + rr;
      I lo[U], hi[U];
      for (int u = 0; u < U; ++u) V::nib_bytes(V::load_u32(kn[u] + static_cast<ptrdiff_t>(r) * bsp), lo[u], hi[u]);
      for (int g = 0; g < GT; ++g)
        for (int l = 0; l < 3; ++l) {  // two limb registers at a time
          const int32_t* wl = limbs + (g * 3 + l) * D4 + 2 * r;
          const I w0 = V::iset1(wl[0]), w1 = V::iset1(wl[1]);
          for (int u = 0; u < U; ++u) a[g][u][l] = V::dpbusd(V::dpbusd(a[g][u][l], lo[u], w0), hi[u], w1);
        }
    }
    for (int u = 0; u < U; ++u) {
      const F ksu = V::load_h(ks[u] + static_cast<size_t>(grp) * bsp), kzu = V::load_h(kz[u] + static_cast<size_t>(grp) * bsp);
      for (int g = 0; g < GT; ++g) {
        const F dot = V::fma(V::cvt(a[g][u][0]), V::set1(65536.0f),
                             V::fma(V::cvt(a[g][u][1]), V::set1(256.0f), V::cvt(a[g][u][2])));
        const F f = V::set1(fs[g * ng + grp]), z = V::set1(qsum[g * ng + grp]);
        if (GT == 1) {
          s[u] = V::fma(ksu, V::mul(dot, f), s[u]);
          s[u] = V::fma(kzu, z, s[u]);
        } else {
          float* o = out[u] + g * ps;
          V::store(o, V::fma(kzu, z, V::fma(ksu, V::mul(dot, f), V::load(o))));
        }
      }
    }
  }
  if (GT == 1)
    for (int u = 0; u < U; ++u) V::store(out[u], s[u]);
  pf_io = pf;
}

// Column units scored together: 4 for one row, 2 for 2-4 rows (more rows score block by block); and
// the row groups they go in (4 rows as 2 x 2: all 4 at once needed 31 of the 32 vector registers).
template <int GT>
constexpr int vnni_score_units() { return GT == 1 ? 4 : (GT <= 4 ? 2 : 0); }
template <int GT>
constexpr int vnni_score_rows() { return GT == 4 ? 2 : GT; }

// The scores of nb int4 blocks (heads[c], n tokens each but the last) for GT rows (P row stride ps), in
// batches of vnni_score_units column units.
template <int GT, int KG>
static void scores_int4_vnni_rows(const Layout& L, const uint8_t* const* heads, int nb, int n_last,
                                  const int32_t* limbs, const float* fs, const float* qsum, float* P, int ps,
                                  PrefetchRun& pf) {
  constexpr int UM = vnni_score_units<GT>() > 0 ? vnni_score_units<GT>() : 1;
  const int bsp = L.bsp;
  const uint32_t* kn[UM];
  const uint16_t *ks[UM], *kz[UM];
  float* out[UM];
  int u = 0;
  constexpr int GH = vnni_score_rows<GT>();
  const int D4 = L.head_dim / 4, nkg = L.head_dim / L.kgroup;
  auto flush = [&]() {
    for (int g0 = 0; g0 < GT; g0 += GH) {
      const int32_t* lg = limbs + g0 * 3 * D4;
      const float *fg = fs + g0 * nkg, *qg = qsum + g0 * nkg;
      float* og[UM];
      for (int i = 0; i < u; ++i) og[i] = out[i] + g0 * ps;
      if (u == UM) scores_int4_vnni_units<GH, UM, KG>(L, kn, ks, kz, og, ps, lg, fg, qg, pf);
      else if (UM == 4 && u == 3) scores_int4_vnni_units<GH, (UM == 4 ? 3 : 1), KG>(L, kn, ks, kz, og, ps, lg, fg, qg, pf);
      else if (UM == 4 && u == 2) scores_int4_vnni_units<GH, (UM == 4 ? 2 : 1), KG>(L, kn, ks, kz, og, ps, lg, fg, qg, pf);
      else if (u == 1) scores_int4_vnni_units<GH, 1, KG>(L, kn, ks, kz, og, ps, lg, fg, qg, pf);
    }
    u = 0;
  };
  for (int c = 0; c < nb; ++c) {
    const uint8_t* head = heads[c];
    const int n = c == nb - 1 ? n_last : bsp;
    for (int c0 = 0; c0 < n; c0 += W) {
      kn[u] = reinterpret_cast<const uint32_t*>(head + L.k_off) + c0;
      ks[u] = reinterpret_cast<const uint16_t*>(head + L.ks_off) + c0;
      kz[u] = reinterpret_cast<const uint16_t*>(head + L.kz_off) + c0;
      out[u] = P + c * bsp + c0;
      if (++u == UM) flush();
    }
  }
  flush();
}
#endif

// Online softmax over one chunk of blocks for the GT heads of a tile; the heads are
// independent, so their reductions overlap. P[g * ps + 0..n) holds scores in log2
// units (-inf where no token is); on return 2^(s - m), with zeros up to the next
// multiple of W.
// m[g] is the running max, l[g * W ..] the running sum as W lanes, and
// corr[g] the factor the accumulators of head g must be scaled by.
// The running max moves only when a chunk's scores exceed it by more than kMaxSlack (log2 units),
// so probabilities reach 2^kMaxSlack. The branch is rarely taken after the first chunk: predicted,
// it lets the exps start before the chunk's max is known (with a select they waited for it: fp16
// took 1.03-1.05x the time in cache, 1.00-1.11x from DRAM), and the accumulators are rarely
// rescaled.
constexpr float kMaxSlack = 8.0f;

template <int GT>
static void softmax_tile(float* P, int ps, int n, float* m, float* l, float* corr) {
  const int nr = (n + W - 1) / W * W;
  for (int g = 0; g < GT; ++g) {
    float* p = P + g * ps;
    for (int t = n; t < nr; ++t) p[t] = -__builtin_inff();
    F mx = V::load(p);
    for (int c0 = W; c0 < nr; c0 += W) mx = V::max(mx, V::load(p + c0));
    const float bm = V::hmax(mx);
    corr[g] = 1.0f;
    if (__builtin_expect(bm > m[g] + kMaxSlack, 0)) {
      __asm__ volatile("");  // keeps the branch (the compiler turns it into selects otherwise)
      // 0 on the first chunk; the vector exp2 (a call to exp2f made every zmm register a spill)
      corr[g] = V::first(V::exp2(V::set1(m[g] - bm)));
      m[g] = bm;
    }
  }
  for (int g = 0; g < GT; ++g) {
    float* p = P + g * ps;
    const F mv = V::set1(m[g]);
    F sum = V::mul(V::set1(corr[g]), V::load(l + g * W));
    for (int c0 = 0; c0 < nr; c0 += W) {
      const F e = V::exp2(V::sub(V::load(p + c0), mv));
      V::store(p + c0, e);
      sum = V::add(sum, e);
    }
    V::store(l + g * W, sum);
  }
}

// Vectors of D kept in registers per head in the PV loop (GT heads + one V row).
template <int GT>
constexpr int pv_chunk() {
  return (GT + 1) * 8 <= V::kRegs - 4 ? 8
         : (GT + 1) * 4 <= V::kRegs - 4 ? 4 : ((GT + 1) * 2 <= V::kRegs - 2 ? 2 : 1);
}

template <int GT, int DC>
static void pv_fp16_chunk(const uint16_t* Vr, int D, int n, const float* P, int bsp, float* acc, int d0,
                          Prefetch& pf_io) {
  Prefetch pf = pf_io;  // a local copy stays in registers
  F a[GT][DC];
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < DC; ++j) a[g][j] = V::load(acc + g * D + d0 + j * W);
  const uint16_t* vp = Vr + d0;
  const float* pg[GT];
  for (int g = 0; g < GT; ++g) pg[g] = P + g * bsp;
  for (int t = 0; t < n; ++t, vp += D) {
    pf.step();
    F v[DC];
    for (int j = 0; j < DC; ++j) v[j] = V::load_h(vp + j * W);
    for (int g = 0; g < GT; ++g) {
      const F p = V::set1(pg[g][t]);
      for (int j = 0; j < DC; ++j) a[g][j] = V::fma(p, v[j], a[g][j]);
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < DC; ++j) V::store(acc + g * D + d0 + j * W, a[g][j]);
  pf_io = pf;
}

// acc[g] += sum_t P[g][t] * V_t (fp16 values)
template <int GT>
static void pv_fp16(const Layout& L, const uint8_t* head, int n, const float* P, int ps, float* acc, Prefetch& pf) {
  constexpr int DC = pv_chunk<GT>();
  const int D = L.head_dim;
  const uint16_t* Vr = reinterpret_cast<const uint16_t*>(head + L.v_off);
  int d0 = 0;
  for (; d0 + DC * W <= D; d0 += DC * W) pv_fp16_chunk<GT, DC>(Vr, D, n, P, ps, acc, d0, pf);
  for (; d0 < D; d0 += W) pv_fp16_chunk<GT, 1>(Vr, D, n, P, ps, acc, d0, pf);
}

// One token (TT of its quad) of pv_int4_cols: its low nibbles (and high ones, HI) of CB columns.
template <int TT, int GT, int CB, bool HI>
static inline void pv_int4_token(const typename V::I (&x)[CB], const float* const (&clo)[GT][CB],
                                 const float* const (&chi)[GT][CB], int t, F (&lo)[GT][CB], F (&hi)[GT][CB]) {
  for (int k = 0; k < CB; ++k) {
    const F ul = V::template nib_at<8 * TT>(x[k]);
    for (int g = 0; g < GT; ++g) lo[g][k] = V::fma(V::set1(clo[g][k][t]), ul, lo[g][k]);
    if (HI) {
      const F uh = V::template nib_at<8 * TT + 4>(x[k]);
      for (int g = 0; g < GT; ++g) hi[g][k] = V::fma(V::set1(chi[g][k][t]), uh, hi[g][k]);
    }
  }
}

// acc[g][d] += sum_t Cc[g][d / vg][t] * u_t[d] over nq quads of one block's tokens, for CB columns
// from c0. Column c is W lanes of line c / S (S = 16 / W), from lane (c % S) * W: its low nibbles are
// channels d = 32 (c / S) + (c % S) W + i, its high ones (HI: real channels) d + 16.
template <int GT, int CB, int VG, bool HI>
static void pv_int4_cols(const Layout& L, const uint8_t* Vn, int nq, const float* Cc, float* acc, int c0,
                         Prefetch& pf_io) {
  constexpr int S = 16 / W;
  Prefetch pf = pf_io;  // a local copy stays in registers
  const int D = L.head_dim, vg = VG ? VG : L.vgroup, ng = D / vg, bsp = L.bsp;
  const ptrdiff_t qstride = static_cast<ptrdiff_t>(L.v_quad / 4);  // u32 per quad
  F lo[GT][CB], hi[GT][CB];
  const float *clo[GT][CB], *chi[GT][CB];
  const uint32_t* src[CB];
  int dlo[CB];
  for (int k = 0; k < CB; ++k) {
    const int c = c0 + k;
    dlo[k] = 32 * (c / S) + (c % S) * W;
    src[k] = reinterpret_cast<const uint32_t*>(Vn + (c / S) * 64) + (c % S) * W;
    for (int g = 0; g < GT; ++g) {
      lo[g][k] = V::load(acc + g * D + dlo[k]);
      hi[g][k] = HI ? V::load(acc + g * D + dlo[k] + 16) : V::zero();
      clo[g][k] = Cc + (g * ng + dlo[k] / vg) * bsp;
      chi[g][k] = Cc + (g * ng + (HI ? dlo[k] + 16 : dlo[k]) / vg) * bsp;
    }
  }
  for (int qd = 0; qd < nq; ++qd) {
    pf.step(); pf.step(); pf.step(); pf.step();  // one step per token
    typename V::I x[CB];
    for (int k = 0; k < CB; ++k) x[k] = V::load_u32(src[k] + qd * qstride);
    pv_int4_token<0, GT, CB, HI>(x, clo, chi, 4 * qd, lo, hi);
    pv_int4_token<1, GT, CB, HI>(x, clo, chi, 4 * qd + 1, lo, hi);
    pv_int4_token<2, GT, CB, HI>(x, clo, chi, 4 * qd + 2, lo, hi);
    pv_int4_token<3, GT, CB, HI>(x, clo, chi, 4 * qd + 3, lo, hi);
  }
  for (int k = 0; k < CB; ++k)
    for (int g = 0; g < GT; ++g) {
      V::store(acc + g * D + dlo[k], lo[g][k]);
      if (HI) V::store(acc + g * D + dlo[k] + 16, hi[g][k]);
    }
  pf_io = pf;
}

// acc[g] += sum_t (P[g][t] * scale_t) * u_t;  zacc[g][grp] (W lanes) += sum_t P[g][t] * zero_t
template <int GT, int VG>
static void pv_int4(const Layout& L, const uint8_t* head, int n, const float* P, int ps, float* Cc, float* acc,
                    float* zacc, Prefetch& pf) {
  const int D = L.head_dim, bsp = L.bsp, ng = D / L.vgroup, nq = (n + 3) / 4;
  const uint16_t* Vs = reinterpret_cast<const uint16_t*>(head + L.vs_off);
  const uint16_t* Vz = reinterpret_cast<const uint16_t*>(head + L.vz_off);
  const int nr = (n + W - 1) / W * W;  // P is zero on [n, nr)
  for (int grp = 0; grp < ng; ++grp) {
    for (int c0 = 0; c0 < nr; c0 += W) {
      const F sc = V::load_h(Vs + grp * bsp + c0), zr = V::load_h(Vz + grp * bsp + c0);  // once for the GT heads
      for (int g = 0; g < GT; ++g) {
        const F p = V::load(P + g * ps + c0);
        V::store(Cc + (g * ng + grp) * bsp + c0, V::mul(p, sc));
        float* z = zacc + (g * ng + grp) * W;
        V::store(z, V::fma(p, zr, V::load(z)));
      }
    }
    for (int t = nr; t < 4 * nq; ++t)  // W < 4: the quad's tokens past n
      for (int g = 0; g < GT; ++g) Cc[(g * ng + grp) * bsp + t] = 0.0f;
  }
  constexpr int S = 16 / W, CB = GT == 1 ? 4 : (GT == 2 ? 2 : 1);  // columns in flight: 2 GT CB chains
  const uint8_t* Vn = head + L.v_off;
  const int full = D / 32 * S;  // columns with high channels
  int c = 0;
  for (; c + CB <= full; c += CB) pv_int4_cols<GT, CB, VG, true>(L, Vn, nq, Cc, acc, c, pf);
  for (; c < full; ++c) pv_int4_cols<GT, 1, VG, true>(L, Vn, nq, Cc, acc, c, pf);
  if (D % 32)
    for (; c < full + S; ++c) pv_int4_cols<GT, 1, VG, false>(L, Vn, nq, Cc, acc, c, pf);
}

// Running state of the rows (query heads) of an item: row rho = j * G + g is query head g
// of the item's j-th kv head. P holds the scores / probabilities of the tile (<= 8 rows) in work.
struct ItemState {
  float *m, *l, *qsum, *acc, *zacc, *P, *Cc, *fs, *fc;
  int32_t* limbs;  // integer path only: q of each row in fixed point (q_limbs)
  int32_t* Cq;     // integer path only: a tile's P V coefficients in fixed point (pv_int4_vnni_chunk)
};

// Scores of one block for GT query heads (rows rho.. of one kv head) into P (row stride ps).
// l1_values: also fetch the block's V part into L1 for the P V that follows the chunk's scores (int4:
// the region is small, and its V waiting in L2 stalled the P V loop).
template <int GT, int KG>
static void score_tile(const Layout& L, const uint8_t* head, int n, const float* q, const ItemState& st, int rho,
                       int nkg, float* P, int ps, Prefetch& pf, bool l1_values = false) {
  if (l1_values)
    for (size_t o = L.v_off; o < L.head_bytes; o += 64) __builtin_prefetch(head + o, 0, 3);
  if (!L.int4) return scores_fp16<GT>(L, head, n, q, P, ps, pf);
#ifdef FD_VNNI
  const int32_t* limbs = st.limbs + rho * 3 * (L.head_dim / 4);
  const float *fs = st.fs + rho * nkg, *qsum = st.qsum + rho * nkg;
  return scores_int4_vnni<GT, KG>(L, head, n, limbs, fs, qsum, P, ps);
#else
  return scores_int4<GT>(L, head, n, q, st.qsum + rho * nkg, P, ps);
#endif
}

// Online-softmax update of GT rows from rho over n positions of their P rows:
// probabilities into P, and the rows' accumulators rescaled where their running max moved.
template <int GT>
static void softmax_rows(const Layout& L, int n, const ItemState& st, int rho, int nvg, int ps) {
  const int D = L.head_dim;
  float corr[GT];
  softmax_tile<GT>(st.P, ps, n, st.m + rho, st.l + rho * W, corr);
  for (int g = 0; g < GT; ++g) {
    if (corr[g] == 1.0f) continue;
    const F c = V::set1(corr[g]);
    float* acc = st.acc + (rho + g) * D;
    for (int d = 0; d < D; d += W) V::store(acc + d, V::mul(c, V::load(acc + d)));
    float* z = st.zacc + (rho + g) * nvg * W;
    for (int i = 0; i < nvg * W; i += W) V::store(z + i, V::mul(c, V::load(z + i)));
  }
}

// P V of one block for GT rows from rho of one kv head; P is the block's slice of their rows.
template <int GT, int VG>
static void pv_tile(const Layout& L, const uint8_t* head, int n, const ItemState& st, int rho, int nvg,
                    const float* P, int ps, Prefetch& pf) {
  float* acc = st.acc + rho * L.head_dim;
  float* zacc = st.zacc + rho * nvg * W;
  if (L.int4)
    pv_int4<GT, VG>(L, head, n, P, ps, st.Cc, acc, zacc, pf);
  else
    pv_fp16<GT>(L, head, n, P, ps, acc, pf);
}

#define FD_TILE_SWITCH(gt, call)            \
  switch (gt) {                             \
    case 1: call(1); break;                 \
    case 2: call(2); break;                 \
    case 3: call(3); break;                 \
    case 4: call(4); break;                 \
    case 5: call(5); break;                 \
    case 6: call(6); break;                 \
    case 7: call(7); break;                 \
    default: call(8); break;                \
  }

static inline float* align16(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~static_cast<uintptr_t>(63));
}

#ifdef FD_VNNI
// The P V of a chunk's int4 blocks with integer dot products, for GT rows. Per (row, value group) the
// chunk's coefficients c_t = p_t * scale_t >= 0 are fixed point, c_t ~= fc * (a_t 2^16 + b_t 2^8 + e_t)
// with bytes a, b, e and fc = max_t c_t / (255 * 2^16): |c_t - that| <= fc / 2, the size of the fp32
// rounding of the largest c_t. The bytes of a quad of tokens form one 32-bit lane, the unsigned
// operand of vpdpbusd against the quad's nibbles of 16 channels (the V layout); the three limbs sum
// exactly in int32 over the chunk and combine in fp32 once per chunk.
// Cq[(g * ng + grp) * ps + 4 * quad + limb]: the limbs of the chunk's quads (positions c * bsp + t),
// the three of a quad side by side (one shuffle of 16 quantized positions writes 4 quads); fc[g * ng +
// grp]: the step.

// VB vectors of 16 channels from j0 for GT rows over the chunk's nb blocks. ONE: the VB vectors lie
// in one value group.
template <int GT, int VB, int VG, bool ONE>
static void pv_int4_vnni_vectors(const Layout& L, const uint8_t* const* heads, int nb, int nq_last,
                                 const int32_t* Cq, int ps, const float* fc, float* acc, int j0,
                                 PrefetchRun& pf_io) {
  typedef typename V::I I;
  PrefetchRun pf = pf_io;  // a local copy stays in registers
  const int D = L.head_dim, bsp = L.bsp, vg = VG ? VG : L.vgroup, ng = D / vg;
  const ptrdiff_t qstride = static_cast<ptrdiff_t>(L.v_quad);
  const I m15 = _mm512_set1_epi8(15);
  int grp[VB];
  for (int k = 0; k < VB; ++k) grp[k] = 16 * (j0 + k) / vg;
  I a[GT][3][VB];
  for (int g = 0; g < GT; ++g)
    for (int l = 0; l < 3; ++l)
      for (int k = 0; k < VB; ++k) a[g][l][k] = V::izero();
  int off[GT][VB];  // Cq of (row, vector)
  for (int g = 0; g < GT; ++g)
    for (int k = 0; k < VB; ++k) off[g][k] = (g * ng + grp[k]) * ps;
  const bool hi0 = j0 % 2;  // VB == 1: the high nibbles of line j0 / 2
  for (int c = 0; c < nb; ++c) {
    const int nq = c == nb - 1 ? nq_last : bsp / 4;
    const uint8_t* vp = heads[c] + L.v_off + (j0 / 2) * 64;
    const int32_t* cq = Cq + c * bsp;
    pf.step(nq);
    for (int qd = 0; qd < nq; ++qd, vp += qstride, cq += 4) {
      I u[VB];
      for (int k = 0; k < VB; ++k) {
        const I x = V::load_u32(reinterpret_cast<const uint32_t*>(vp + (VB == 1 ? 0 : k / 2 * 64)));
        const bool hi = VB == 1 ? hi0 : k % 2;
        u[k] = hi ? _mm512_and_si512(_mm512_srli_epi16(x, 4), m15) : _mm512_and_si512(x, m15);
      }
      for (int g = 0; g < GT; ++g)  // a row's limbs in 3 registers at a time (GT 4 x 2 vectors: 24 accumulators)
        for (int l = 0; l < 3; ++l) {
          I w = V::iset1(cq[off[g][0] + l]);
          for (int k = 0; k < VB; ++k) {
            if (!ONE && k > 0 && (16 * (j0 + k)) % vg == 0) w = V::iset1(cq[off[g][k] + l]);  // a new group
            a[g][l][k] = V::dpbusd(a[g][l][k], w, u[k]);  // u8 coefficients x s8 nibbles
          }
        }
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int k = 0; k < VB; ++k) {
      const F dot = V::fma(V::cvt(a[g][0][k]), V::set1(65536.0f),
                           V::fma(V::cvt(a[g][1][k]), V::set1(256.0f), V::cvt(a[g][2][k])));
      float* o = acc + g * D + 16 * (j0 + k);
      V::store(o, V::fma(dot, V::set1(fc[g * ng + grp[k]]), V::load(o)));
    }
  pf_io = pf;
}

// 16-channel vectors in flight in pv_int4_vnni_vectors (3 GT per vector accumulators), and the passes
// over the chunk's values that makes at head_dim D.
template <int GT>
constexpr int vnni_pv_vectors() { return GT <= 2 ? 4 : (GT <= 4 ? 2 : 1); }
template <int GT>
inline int vnni_pv_passes(int D) {
  return (D / 16) % vnni_pv_vectors<GT>() ? D / 16 : D / 16 / vnni_pv_vectors<GT>();
}

// The chunk's nb int4 blocks (heads[c], all full but the last, which holds n_last tokens) for GT rows
// from P (row stride ps, block c at c * bsp); zacc as in pv_int4. pf steps once per quad and pass.
template <int GT, int VG>
static void pv_int4_vnni_chunk(const Layout& L, const uint8_t* const* heads, int nb, int n_last, const float* P,
                               int ps, int32_t* Cq, float* fc, float* acc, float* zacc, PrefetchRun& pf) {
  const int D = L.head_dim, bsp = L.bsp, vg = VG ? VG : L.vgroup, ng = D / vg;
  const int nq_last = (n_last + 3) / 4, nr_last = (n_last + W - 1) / W * W;  // P is zero on [n_last, nr_last)
  for (int g = 0; g < GT; ++g)
    for (int grp = 0; grp < ng; ++grp) {
      F mx = V::zero();
      float* z = zacc + (g * ng + grp) * W;
      F zs = V::load(z);
      for (int c = 0; c < nb; ++c) {
        const uint16_t* Vs = reinterpret_cast<const uint16_t*>(heads[c] + L.vs_off) + grp * bsp;
        const uint16_t* Vz = reinterpret_cast<const uint16_t*>(heads[c] + L.vz_off) + grp * bsp;
        const float* p = P + g * ps + c * bsp;
        for (int t = 0; t < (c == nb - 1 ? nr_last : bsp); t += W) {
          const F pt = V::load(p + t);
          mx = V::max(mx, V::mul(pt, V::load_h(Vs + t)));
          zs = V::fma(pt, V::load_h(Vz + t), zs);
        }
      }
      V::store(z, zs);
      const float m = V::hmax(mx);
      fc[g * ng + grp] = m > 0.0f ? m * (1.0f / 16711680.0f) : 1.0f;
      const F inv = V::set1(m > 0.0f ? 16711680.0f / m : 1.0f);
      for (int c = 0; c < nb; ++c) {
        const uint16_t* Vs = reinterpret_cast<const uint16_t*>(heads[c] + L.vs_off) + grp * bsp;
        const float* p = P + g * ps + c * bsp;
        for (int t = 0; t < (c == nb - 1 ? nr_last : bsp); t += W) {
          const __m512i q = _mm512_cvtps_epi32(V::mul(V::mul(V::load(p + t), V::load_h(Vs + t)), inv));
          // A 128-bit lane holds the 4 tokens of a quad: bytes 2, 1, 0 of its dwords become its limbs.
          const __m512i pick = _mm512_broadcast_i32x4(
              _mm_setr_epi8(2, 6, 10, 14, 1, 5, 9, 13, 0, 4, 8, 12, -128, -128, -128, -128));
          _mm512_storeu_si512(Cq + (g * ng + grp) * ps + c * bsp + t, _mm512_shuffle_epi8(q, pick));
        }
      }
    }
  constexpr int VB = vnni_pv_vectors<GT>();
  const int nv = D / 16;
  if (nv % VB == 0 && vg >= 16 * VB) {
    for (int j0 = 0; j0 < nv; j0 += VB)
      pv_int4_vnni_vectors<GT, VB, VG, true>(L, heads, nb, nq_last, Cq, ps, fc, acc, j0, pf);
  } else if (nv % VB == 0) {
    for (int j0 = 0; j0 < nv; j0 += VB)
      pv_int4_vnni_vectors<GT, VB, VG, false>(L, heads, nb, nq_last, Cq, ps, fc, acc, j0, pf);
  } else {
    for (int j0 = 0; j0 < nv; ++j0) pv_int4_vnni_vectors<GT, 1, VG, true>(L, heads, nb, nq_last, Cq, ps, fc, acc, j0, pf);
  }
}
#endif

#ifdef FD_VNNI
// chunk_tile for int4 on the integer path: the chunk's int4 blocks scored together (MHA) or block
// by block, one softmax update, their P V together (pv_int4_vnni_chunk), and the fp16 tail block if
// the chunk holds it (its last). The prefetch of the chunk's share of regions ahead runs through all.
template <int GT, int KG, int VG>
static void chunk_int4_vnni(const RegionWalk& w, int i0, int nb, int j, int ntok, const float* q, const ItemState& st,
                            int rho, int nkg, int nvg, int ps, RegionWalk* pfw, const uint8_t* tail) {
  const Layout& L = *w.L;
  const int bs = L.block_size, bsp = L.bsp, D = L.head_dim;
  float* P = st.P;
  auto tokens = [&](int c) { return ntok - (i0 + c) * bs < bs ? ntok - (i0 + c) * bs : bs; };
  const int tail_c = tail ? w.nblk - 1 - i0 : -1;
  const int nq = tail_c >= 0 && tail_c < nb ? tail_c : nb;  // int4 blocks
  const uint8_t* heads[kChunkBlocksInt4];
  for (int c = 0; c < nq; ++c) heads[c] = w.at(i0 + c, j);
  PrefetchRun pf;
  if (pfw && nq > 0) {  // the int4 blocks before the last are full
    const int n_last = tokens(nq - 1);
    const int units = (nq - 1) * (bsp / W) + (n_last + W - 1) / W;
    const int quads = (nq - 1) * (bsp / 4) + (n_last + 3) / 4;
    constexpr int U = vnni_score_units<GT>();
    const int score_steps = U ? GT / vnni_score_rows<GT>() * (D / 8) * ((units + U - 1) / (U ? U : 1)) : 0;  // rows
    const int steps = score_steps + vnni_pv_passes<GT>(D) * quads;
    const int lines = nb * static_cast<int>(L.head_bytes / 64);
    pf.w = pfw;
    pf.regions = nb;
    pf.per_step = (lines + steps - 1) / (steps > 0 ? steps : 1);
  } else if (pfw) {  // the chunk is the fp16 tail alone: the walk still moves past it
    pfw->next(0);
  }
  if (vnni_score_units<GT>() && nq > 0) {
    for (int c = 0; c < nq; ++c)  // the values into L1 for the P V after the chunk's scores
      for (size_t o = L.v_off; o < L.head_bytes; o += 64) __builtin_prefetch(heads[c] + o, 0, 3);
    scores_int4_vnni_rows<GT, KG>(L, heads, nq, tokens(nq - 1), st.limbs + rho * 3 * (D / 4), st.fs + rho * nkg,
                                  st.qsum + rho * nkg, P, ps, pf);
  }
  Prefetch none;
  int n_all = 0;
  for (int c = 0; c < nb; ++c) {
    const int n = tokens(c);
    if (c == tail_c)
      score_tile<GT, KG>(*w.T, tail, n, q, st, rho, nkg, P + c * bsp, ps, none);
    else if (!vnni_score_units<GT>())
      score_tile<GT, KG>(L, heads[c], n, q, st, rho, nkg, P + c * bsp, ps, none, true);
    if (c < nb - 1 && n < bsp)  // a short block inside the chunk: no token at its tail
      for (int g = 0; g < GT; ++g)
        for (int t = n; t < bsp; ++t) P[g * ps + c * bsp + t] = -__builtin_inff();
    n_all = c * bsp + n;
  }
  softmax_rows<GT>(L, n_all, st, rho, nvg, ps);
  if (nq > 0)
    pv_int4_vnni_chunk<GT, VG>(L, heads, nq, tokens(nq - 1), P, ps, st.Cq, st.fc, st.acc + rho * D,
                               st.zacc + rho * nvg * W, pf);
  if (nq < nb) pv_tile<GT, VG>(*w.T, tail, tokens(nq), st, rho, nvg, P + nq * bsp, ps, none);
}
#endif

// One chunk (blocks i0 .. i0 + nb) of GT rows from rho, all of kv head j: the scores of every
// block, one softmax update, then P V block by block, prefetching from pfw (if given).
template <int GT, int KG, int VG>
static void chunk_tile(const RegionWalk& w, int i0, int nb, int j, int ntok, const float* q, const ItemState& st,
                       int rho, int nkg, int nvg, int ps, RegionWalk* pfw, int pf_lines, const uint8_t* tail) {
#ifdef FD_VNNI
  if (w.L->int4) return chunk_int4_vnni<GT, KG, VG>(w, i0, nb, j, ntok, q, st, rho, nkg, nvg, ps, pfw, tail);
#endif
  const int bs = w.L->block_size, bsp = w.L->bsp;
  float* P = st.P;  // the tile's rows; the next tile reuses it
  // fp16 (one block per chunk): the prefetch of the region ahead runs through the scores and the P V
  // (in the P V alone, its bursts left the scores without requests in flight); int4: in the P V.
  Prefetch pf0;
  if (!w.L->int4 && pfw) {
    const int steps = (bsp / W) * (w.L->head_dim / qk_chains<GT>()) + bs;
    pf0 = pfw->next((static_cast<int>(w.L->head_bytes / 64) + steps - 1) / steps);
  }
  auto tokens = [&](int c) { return ntok - (i0 + c) * bs < bs ? ntok - (i0 + c) * bs : bs; };
  const int tail_c = tail ? w.nblk - 1 - i0 : -1;  // the chunk's block read from its fp16 copy, if any
  int n_all = 0;
  for (int c = 0; c < nb; ++c) {
    const int n = tokens(c);
    if (c == tail_c)  // the fp16 copy of the newest block (a separate call: the common one keeps *w.L fixed)
      score_tile<GT, KG>(*w.T, tail, n, q, st, rho, nkg, P + c * bsp, ps, pf0);
    else
      score_tile<GT, KG>(*w.L, w.at(i0 + c, j), n, q, st, rho, nkg, P + c * bsp, ps, pf0, w.L->int4);
    if (c < nb - 1 && n < bsp)  // a short block inside the chunk: no token at its tail
      for (int g = 0; g < GT; ++g)
        for (int t = n; t < bsp; ++t) P[g * ps + c * bsp + t] = -__builtin_inff();
    n_all = c * bsp + n;
  }
  softmax_rows<GT>(*w.L, n_all, st, rho, nvg, ps);
  for (int c = 0; c < nb; ++c) {
    Prefetch pf = !w.L->int4 ? pf0 : pfw ? pfw->next(pf_lines) : Prefetch();
    if (c == tail_c)
      pv_tile<GT, VG>(*w.T, tail, tokens(c), st, rho, nvg, P + c * bsp, ps, pf);
    else
      pv_tile<GT, VG>(*w.L, w.at(i0 + c, j), tokens(c), st, rho, nvg, P + c * bsp, ps, pf);
    for (; pf.cur < pf.end; pf.cur += 64) V::prefetch(pf.cur);  // a short block: the rest of the region ahead
  }
}


// Work items [begin, end) of the job; scratch holds scratch_floats(L, G, J.head_span) floats.
// Item i is (sequence i / spans, kv heads [h0, h0 + head_span) with h0 = (i % spans) * head_span).
// The item's blocks are walked in chunks of NB, and each chunk head by head: the scores of
// the head's NB regions, one softmax update, then their P V. The regions of a chunk lie side by
// side within each block (a block stores its heads next to each other).
// KG, VG: the int4 groups when fixed at compile time, else 0 (read from the layout).
template <int KG, int VG>
static void run_items_groups(const AttnJob& J, int begin, int end, float* scratch) {
  const Layout& L = *J.L;
  const int D = L.head_dim, G = J.G, Hkv = L.num_kv_heads, bs = L.block_size, bsp = L.bsp;
  const int nkg = L.int4 ? D / L.kgroup : 0, nvg = L.int4 ? D / L.vgroup : 0;
  const int span = J.head_span, spans = (Hkv + span - 1) / span;
  const int NB = J.chunk, ps = NB * bsp;  // ps: P row stride
  float* sp = align16(scratch);
  auto take = [&sp](size_t floats) { float* p = sp; sp = align16(sp + floats); return p; };
  const int rows = span * G;
  ItemState st;
  st.acc = take(static_cast<size_t>(rows) * D);
  st.P = take(static_cast<size_t>(8) * ps);
  st.Cc = take(static_cast<size_t>(8) * nvg * bsp);
  st.m = take(rows);
  st.l = take(static_cast<size_t>(rows) * W);
  st.qsum = take(static_cast<size_t>(rows) * nkg);
  st.zacc = take(static_cast<size_t>(rows) * nvg * 16);
  st.fs = take(static_cast<size_t>(rows) * nkg);
  st.limbs = reinterpret_cast<int32_t*>(take(static_cast<size_t>(rows) * 3 * (D / 4)));
  st.fc = take(static_cast<size_t>(8) * nvg);
  st.Cq = reinterpret_cast<int32_t*>(take(static_cast<size_t>(8) * nvg * ps));
  const size_t pf_bytes = L.int4 ? kPrefetchBytesInt4 * NB : kPrefetchBytesFp16;
  const int pf_regions = static_cast<int>((pf_bytes + L.head_bytes - 1) / L.head_bytes);
  const int pf_lines = static_cast<int>((L.head_bytes / 64 + bs - 1) / bs);  // per token of a region
  // The kernel takes one region of `ahead` per region it reads, so the walk stays pf_regions ahead
  // from one item to the next.
  if (begin >= end) return;
  RegionWalk ahead = RegionWalk::items(J, begin, end);
  for (int i = 0; i < pf_regions; ++i) ahead.advance();
  for (int item = begin; item < end; ++item) {
    const int b = item / spans, h0 = (item % spans) * span;
    const int nh = Hkv - h0 < span ? Hkv - h0 : span;
    const int ntok = J.lens[b];
    const float* qb = J.q + (static_cast<size_t>(b) * J.H + static_cast<size_t>(h0) * G) * D;
    const int nrows = nh * G;  // the item's query heads are consecutive in q: row rho is qb + rho * D
    for (int rho = 0; rho < nrows; ++rho) st.m[rho] = -__builtin_inff();
    std::memset(st.l, 0, sizeof(float) * nrows * W);
    std::memset(st.acc, 0, sizeof(float) * nrows * D);
    std::memset(st.zacc, 0, sizeof(float) * nrows * nvg * W);
    for (int rho = 0; rho < nrows; ++rho)
      for (int grp = 0; grp < nkg; ++grp) {
        float sum = 0.0f;
        for (int d = 0; d < L.kgroup; ++d) sum += qb[rho * D + grp * L.kgroup + d];
        st.qsum[rho * nkg + grp] = sum;
      }
#ifdef FD_VNNI
    if (L.int4) q_limbs<KG>(qb, nrows, D, L.kgroup, st.limbs, st.fs);
#endif
    const int nblk = (ntok + bs - 1) / bs;
    const RegionWalk walk = RegionWalk::of(J, item);
    const int32_t tb = J.tails ? J.tails[b] : -1;
    const uint8_t* tail0 = tb >= 0 ? J.tail_pool + static_cast<size_t>(tb) * J.T->block_bytes : nullptr;
    for (int i0 = 0; i0 < nblk; i0 += NB) {
      const int nb = nblk - i0 < NB ? nblk - i0 : NB;
      for (int j = 0; j < nh; ++j) {
        if (J.write_head && i0 + nb == nblk) J.write_head(J.write_ctx, b, h0 + j);
        for (int g0 = 0; g0 < G; g0 += 8) {  // tiles of at most 8 rows (all of them, for G <= 8)
          const int rho = j * G + g0;
          const float* q = qb + static_cast<size_t>(rho) * D;
          const uint8_t* tail = tail0 ? tail0 + static_cast<size_t>(h0 + j) * J.T->head_bytes : nullptr;
#define FD_CALL(T) chunk_tile<T, KG, VG>(walk, i0, nb, j, ntok, q, st, rho, nkg, nvg, ps, g0 == 0 ? &ahead : nullptr, pf_lines, tail)
          FD_TILE_SWITCH(G - g0 < 8 ? G - g0 : 8, FD_CALL)
#undef FD_CALL
        }
      }
    }
    for (int rho = 0; rho < nrows; ++rho) {
      float* out = J.out + (static_cast<size_t>(b) * J.H + static_cast<size_t>(h0) * G + rho) * D;
      float* acc = st.acc + rho * D;
      const float inv = 1.0f / V::hsum(V::load(st.l + rho * W));
      for (int grp = 0; grp < nvg; ++grp) {  // a value group is a multiple of 16 channels, of W
        const F z = V::set1(V::hsum(V::load(st.zacc + (rho * nvg + grp) * W)));
        for (int d = grp * L.vgroup; d < (grp + 1) * L.vgroup; d += W) V::store(acc + d, V::add(V::load(acc + d), z));
      }
      const F iv = V::set1(inv);
      int d = 0;
      for (; d + W <= D; d += W) V::store(out + d, V::mul(V::load(acc + d), iv));
      for (; d < D; ++d) out[d] = acc[d] * inv;
    }
  }
}

// The common int4 groups get kernels of their own, with the group sizes as constants.
static void run_items(const AttnJob& J, int begin, int end, float* scratch) {
  const Layout& L = *J.L;
  if (L.int4 && L.kgroup == 32 && L.vgroup == 32) return run_items_groups<32, 32>(J, begin, end, scratch);
  if (L.int4 && L.kgroup == 32 && L.vgroup == 64) return run_items_groups<32, 64>(J, begin, end, scratch);
  return run_items_groups<0, 0>(J, begin, end, scratch);
}
