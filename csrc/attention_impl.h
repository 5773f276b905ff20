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
// log2 units (q is pre-multiplied by log2(e) / sqrt(D)). All math in fp32.
// The plain float64 version is `reference_attention` in fastdecode/kernels.py.
//
// int4: a stored value is x = scale * u + zero (u in 0..15, per group of qg
// channels of one token). The kernels never materialise x:
//     q . k   = sum_groups  scale_g * (q . u)_g + zero_g * sum_g(q)
//     sum_t p_t v_t = sum_t (p_t * scale_t) u_t  +  sum_t p_t * zero_t   (per group)

typedef V::F F;
constexpr int W = V::W;

// Independent FMA chains per head, so that GT heads together keep >= 8 in flight.
template <int GT>
constexpr int qk_chains() {
  constexpr int want = (8 + GT - 1) / GT;
  constexpr int fit = (V::kRegs - 4) / GT;  // registers left for accumulators
  return want < fit ? want : (fit > 0 ? fit : 1);
}

// QK for GT query heads against up to one block of fp16 keys: P[g][t] = q_g . k_t
template <int GT>
static void scores_fp16(const Layout& L, const uint8_t* head, int n, const float* q, float* P) {
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
      V::store(P + g * bsp + c0, t);
    }
  }
}

// QK for int4 keys. qsum[g * ng + grp] = sum of q_g over the channels of group grp.
// QG: the group size when known at compile time (0: L.qgroup), so the row loop unrolls.
template <int GT, int QG>
static void scores_int4(const Layout& L, const uint8_t* head, int n, const float* q, const float* qsum,
                        float* P) {
  const int D = L.head_dim, bsp = L.bsp, qg = QG ? QG : L.qgroup, ng = D / qg;
  const uint8_t* Kn = head + L.k_off;
  const uint16_t* Ks = reinterpret_cast<const uint16_t*>(head + L.ks_off);
  const uint16_t* Kz = reinterpret_cast<const uint16_t*>(head + L.kz_off);
  for (int c0 = 0; c0 < n; c0 += W) {
    F s[GT];
    for (int g = 0; g < GT; ++g) s[g] = V::zero();
    for (int grp = 0; grp < ng; ++grp) {
      constexpr int R = GT == 1 ? 4 : (GT == 2 ? 2 : 1);  // channel-pair rows per step: 2R chains per head
      F r[GT][2 * R];
      for (int g = 0; g < GT; ++g)
        for (int j = 0; j < 2 * R; ++j) r[g][j] = V::zero();
      const uint8_t* kr = Kn + static_cast<ptrdiff_t>(grp * qg / 2) * bsp + c0;  // channel-pair rows
      const float* qd[GT];
      for (int g = 0; g < GT; ++g) qd[g] = q + g * D + grp * qg;
#pragma GCC unroll 16
      for (int pr = 0; pr < qg / 2; pr += R, kr += R * static_cast<ptrdiff_t>(bsp)) {
        F lo[R], hi[R];
        for (int j = 0; j < R; ++j) V::nib(kr + j * static_cast<ptrdiff_t>(bsp), lo[j], hi[j]);
        for (int g = 0; g < GT; ++g) {
          for (int j = 0; j < R; ++j) {
            r[g][2 * j] = V::fma(V::set1(qd[g][2 * pr + 2 * j]), lo[j], r[g][2 * j]);
            r[g][2 * j + 1] = V::fma(V::set1(qd[g][2 * pr + 2 * j + 1]), hi[j], r[g][2 * j + 1]);
          }
        }
      }
      const F ks = V::load_h(Ks + static_cast<size_t>(grp) * bsp + c0);
      const F kz = V::load_h(Kz + static_cast<size_t>(grp) * bsp + c0);
      for (int g = 0; g < GT; ++g) {
        F dot = r[g][0];
        for (int j = 1; j < 2 * R; ++j) dot = V::add(dot, r[g][j]);
        s[g] = V::fma(ks, dot, s[g]);
        s[g] = V::fma(kz, V::set1(qsum[g * ng + grp]), s[g]);
      }
    }
    for (int g = 0; g < GT; ++g) V::store(P + g * bsp + c0, s[g]);
  }
}

// Online softmax over one block for the GT heads of a tile; the heads are
// independent, so their reductions overlap. P[g][0..n) holds scores in log2
// units; on return 2^(s - m_new), with zeros up to the next multiple of W.
// m[g] is the running max, l[g * W ..] the running sum as W lanes, and
// corr[g] the factor the accumulators of head g must be scaled by.
template <int GT>
static void softmax_tile(float* P, int bsp, int n, float* m, float* l, float* corr) {
  const int nr = (n + W - 1) / W * W;
  float m_new[GT];
  for (int g = 0; g < GT; ++g) {
    float* p = P + g * bsp;
    for (int t = n; t < nr; ++t) p[t] = -__builtin_inff();
    F mx = V::load(p);
    for (int c0 = W; c0 < nr; c0 += W) mx = V::max(mx, V::load(p + c0));
    const float bm = V::hmax(mx);
    m_new[g] = m[g] > bm ? m[g] : bm;
  }
  for (int g = 0; g < GT; ++g) {
    corr[g] = m_new[g] == m[g] ? 1.0f : __builtin_exp2f(m[g] - m_new[g]);  // 0 on the first block
    m[g] = m_new[g];
  }
  for (int g = 0; g < GT; ++g) {
    float* p = P + g * bsp;
    const F mv = V::set1(m_new[g]);
    F sum = V::mul(V::set1(corr[g]), V::load(l + g * W));
    for (int c0 = 0; c0 < nr; c0 += W) {
      const F e = V::exp2(V::sub(V::load(p + c0), mv));
      V::store(p + c0, e);
      sum = V::add(sum, e);
    }
    V::store(l + g * W, sum);
  }
}

// Software prefetch of a later block's head region, spread over the PV token
// loop of this block (a burst of 100+ prefetches would stall on fill buffers).
struct Prefetch {
  const uint8_t* cur = nullptr;  // next line to prefetch; nullptr: nothing to do
  const uint8_t* end = nullptr;
  int per_step = 0;              // lines per step()
  inline void step() {
    for (int i = 0; i < per_step && cur < end; ++i, cur += 64) V::prefetch(cur);
  }
};

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
static void pv_fp16(const Layout& L, const uint8_t* head, int n, const float* P, float* acc, Prefetch& pf) {
  constexpr int DC = pv_chunk<GT>();
  const int D = L.head_dim;
  const uint16_t* Vr = reinterpret_cast<const uint16_t*>(head + L.v_off);
  int d0 = 0;
  for (; d0 + DC * W <= D; d0 += DC * W) pv_fp16_chunk<GT, DC>(Vr, D, n, P, L.bsp, acc, d0, pf);
  for (; d0 < D; d0 += W) pv_fp16_chunk<GT, 1>(Vr, D, n, P, L.bsp, acc, d0, pf);
}

template <int GT, int GC, int QG>
static void pv_int4_groups(int D, int ng, int half_rt, int bsp, int n, const uint8_t* Vn, const float* Cc, float* acc,
                           Prefetch& pf_io) {
  Prefetch pf = pf_io;  // a local copy stays in registers
  const int half = QG ? QG / 2 : half_rt, qg = 2 * half;
  if constexpr (GT == 1 && GC == 4) {  // the MHA case, in named registers (arrays were spilled)
    for (int g0 = 0; g0 < ng; g0 += 4) {
      for (int i = 0; i < half; i += W) {
        float* a = acc + g0 * qg + i;
        F l0 = V::load(a), h0 = V::load(a + half), l1 = V::load(a + qg), h1 = V::load(a + qg + half);
        F l2 = V::load(a + 2 * qg), h2 = V::load(a + 2 * qg + half);
        F l3 = V::load(a + 3 * qg), h3 = V::load(a + 3 * qg + half);
        const uint8_t* src = Vn + g0 * half + i;
        const float *c0 = Cc + g0 * bsp, *c1 = c0 + bsp, *c2 = c1 + bsp, *c3 = c2 + bsp;
        for (int t = 0; t < n; ++t, src += D / 2) {
          pf.step();
          F lo, hi, k;
          V::nib(src, lo, hi);
          k = V::set1(c0[t]); l0 = V::fma(k, lo, l0); h0 = V::fma(k, hi, h0);
          V::nib(src + half, lo, hi);
          k = V::set1(c1[t]); l1 = V::fma(k, lo, l1); h1 = V::fma(k, hi, h1);
          V::nib(src + 2 * half, lo, hi);
          k = V::set1(c2[t]); l2 = V::fma(k, lo, l2); h2 = V::fma(k, hi, h2);
          V::nib(src + 3 * half, lo, hi);
          k = V::set1(c3[t]); l3 = V::fma(k, lo, l3); h3 = V::fma(k, hi, h3);
        }
        V::store(a, l0); V::store(a + half, h0); V::store(a + qg, l1); V::store(a + qg + half, h1);
        V::store(a + 2 * qg, l2); V::store(a + 2 * qg + half, h2);
        V::store(a + 3 * qg, l3); V::store(a + 3 * qg + half, h3);
      }
    }
    pf_io = pf;
    return;
  }
  for (int g0 = 0; g0 < ng; g0 += GC) {
    for (int i = 0; i < half; i += W) {
      F lo_acc[GT][GC], hi_acc[GT][GC];
      for (int g = 0; g < GT; ++g)
        for (int c = 0; c < GC; ++c) {
          lo_acc[g][c] = V::load(acc + g * D + (g0 + c) * qg + i);
          hi_acc[g][c] = V::load(acc + g * D + (g0 + c) * qg + half + i);
        }
      const uint8_t* src = Vn + g0 * half + i;
      const float* cg[GT][GC];  // per-token coefficients p_t * scale_t of (head, group)
      for (int g = 0; g < GT; ++g)
        for (int c = 0; c < GC; ++c) cg[g][c] = Cc + (g * ng + g0 + c) * bsp;
      for (int t = 0; t < n; ++t, src += D / 2) {
        if ((t & 3) == 0) {  // prefetch for 4 tokens at once: GCC spills fewer accumulators
          pf.step(); pf.step(); pf.step(); pf.step();
        }
        for (int c = 0; c < GC; ++c) {
          F lo, hi;
          V::nib(src + c * half, lo, hi);
          for (int g = 0; g < GT; ++g) {
            const F coef = V::set1(cg[g][c][t]);
            lo_acc[g][c] = V::fma(coef, lo, lo_acc[g][c]);
            hi_acc[g][c] = V::fma(coef, hi, hi_acc[g][c]);
          }
        }
      }
      for (int g = 0; g < GT; ++g)
        for (int c = 0; c < GC; ++c) {
          V::store(acc + g * D + (g0 + c) * qg + i, lo_acc[g][c]);
          V::store(acc + g * D + (g0 + c) * qg + half + i, hi_acc[g][c]);
        }
    }
  }
  pf_io = pf;
}

// acc[g] += sum_t (P[g][t] * scale_t) * u_t;  zacc[g][grp] (W lanes) += sum_t P[g][t] * zero_t
template <int GT, int QG>
static void pv_int4(const Layout& L, const uint8_t* head, int n, const float* P, float* Cc, float* acc,
                    float* zacc, Prefetch& pf) {
  const int D = L.head_dim, bsp = L.bsp, qg = L.qgroup, ng = D / qg, half = qg / 2;
  const uint8_t* Vn = head + L.v_off;
  const uint16_t* Vs = reinterpret_cast<const uint16_t*>(head + L.vs_off);
  const uint16_t* Vz = reinterpret_cast<const uint16_t*>(head + L.vz_off);
  const int nr = (n + W - 1) / W * W;  // P is zero on [n, nr)
  for (int g = 0; g < GT; ++g) {
    for (int grp = 0; grp < ng; ++grp) {
      F z = V::load(zacc + (g * ng + grp) * W);
      for (int c0 = 0; c0 < nr; c0 += W) {
        const F p = V::load(P + g * bsp + c0);
        V::store(Cc + (g * ng + grp) * bsp + c0, V::mul(p, V::load_h(Vs + grp * bsp + c0)));
        z = V::fma(p, V::load_h(Vz + grp * bsp + c0), z);
      }
      V::store(zacc + (g * ng + grp) * W, z);
    }
  }
  constexpr int GC = GT == 1 ? 4 : (GT == 2 ? 2 : 1);  // groups in flight: >= 8 FMA chains
  if (ng % GC == 0)
    pv_int4_groups<GT, GC, QG>(D, ng, half, bsp, n, Vn, Cc, acc, pf);
  else
    pv_int4_groups<GT, 1, QG>(D, ng, half, bsp, n, Vn, Cc, acc, pf);
}

// Running state of one kv head of an item (its G query heads), pointers into the
// thread's scratch; P and Cc are per-block temporaries shared by the item's heads.
struct ItemState {
  float *m, *l, *qsum, *acc, *zacc, *P, *Cc;
};

// One block, GT query heads (a tile of the item's G heads starting at g0).
template <int GT>
static void tile(const Layout& L, const uint8_t* head, int n, const float* q, const ItemState& st, int g0,
                 int ng, Prefetch& pf) {
  const int D = L.head_dim, bsp = L.bsp;
  float* P = st.P + g0 * bsp;
  float* acc = st.acc + g0 * D;
  if (L.int4 && L.qgroup == 32)
    scores_int4<GT, 32>(L, head, n, q + g0 * D, st.qsum + g0 * ng, P);
  else if (L.int4)
    scores_int4<GT, 0>(L, head, n, q + g0 * D, st.qsum + g0 * ng, P);
  else
    scores_fp16<GT>(L, head, n, q + g0 * D, P);
  float corr[GT];
  softmax_tile<GT>(P, bsp, n, st.m + g0, st.l + g0 * W, corr);
  for (int g = 0; g < GT; ++g) {
    if (corr[g] != 1.0f) {
      const F c = V::set1(corr[g]);
      for (int d = 0; d < D; d += W) V::store(acc + g * D + d, V::mul(c, V::load(acc + g * D + d)));
      for (int i = 0; i < ng * W; i += W) {
        float* z = st.zacc + (g0 + g) * ng * W + i;
        V::store(z, V::mul(c, V::load(z)));
      }
    }
  }
  if (L.int4 && L.qgroup == 32)
    pv_int4<GT, 32>(L, head, n, P, st.Cc, acc, st.zacc + g0 * ng * W, pf);
  else if (L.int4)
    pv_int4<GT, 0>(L, head, n, P, st.Cc, acc, st.zacc + g0 * ng * W, pf);
  else
    pv_fp16<GT>(L, head, n, P, acc, pf);
}

static void tile_any(int gt, const Layout& L, const uint8_t* head, int n, const float* q, const ItemState& st,
                     int g0, int ng, Prefetch& pf) {
  switch (gt) {
    case 1: tile<1>(L, head, n, q, st, g0, ng, pf); break;
    case 2: tile<2>(L, head, n, q, st, g0, ng, pf); break;
    case 3: tile<3>(L, head, n, q, st, g0, ng, pf); break;
    case 4: tile<4>(L, head, n, q, st, g0, ng, pf); break;
    case 5: tile<5>(L, head, n, q, st, g0, ng, pf); break;
    case 6: tile<6>(L, head, n, q, st, g0, ng, pf); break;
    case 7: tile<7>(L, head, n, q, st, g0, ng, pf); break;
    default: tile<8>(L, head, n, q, st, g0, ng, pf); break;
  }
}

static inline float* align16(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~static_cast<uintptr_t>(63));
}

// Bytes ahead the kernel prefetches, in the order it reads: (block, kv head) regions of
// an item, heads inner. A region is 8 KiB at fp16 and 2.5 KiB at int4 (D=128); int4
// regions are small, so their successors must be requested earlier.
// Measured (1 thread, Zen 5, this layout): fp16 best at 4-8 KiB ahead (16 KiB and more is
// slower), int4 flat from 8 KiB on and 1.6x slower at one region (2.5 KiB) ahead.
constexpr size_t kPrefetchBytesFp16 = 8192, kPrefetchBytesInt4 = 16384;

// Work items [begin, end) of the job; scratch holds scratch_floats(L, G, J.head_span) floats.
// Item i is (sequence i / spans, kv heads [h0, h0 + head_span) with h0 = (i % spans) * head_span).
// Blocks are walked outermost and the item's heads inside each block, so the reads of one
// block are one contiguous run of head_span regions (a block stores its heads side by side).
static void run_items(const AttnJob& J, int begin, int end, float* scratch) {
  const Layout& L = *J.L;
  const int D = L.head_dim, G = J.G, Hkv = L.num_kv_heads, bs = L.block_size, bsp = L.bsp;
  const int ng = L.int4 ? D / L.qgroup : 0;
  const int span = J.head_span, spans = (Hkv + span - 1) / span;
  ItemState st[kMaxHeadSpan];
  float* s = align16(scratch);
  float* P = s;  s = align16(s + G * bsp);
  float* Cc = s; s = align16(s + 8 * ng * bsp);
  for (int j = 0; j < span; ++j) {
    st[j].P = P;
    st[j].Cc = Cc;
    st[j].m = s;        s = align16(s + G);
    st[j].l = s;        s = align16(s + G * W);
    st[j].qsum = s;     s = align16(s + G * ng);
    st[j].acc = s;      s = align16(s + G * D);
    st[j].zacc = s;     s = align16(s + G * ng * 16);
  }
  const size_t pf_bytes = L.int4 ? kPrefetchBytesInt4 : kPrefetchBytesFp16;
  const int pf_regions = static_cast<int>((pf_bytes + L.head_bytes - 1) / L.head_bytes);
  const int pf_lines = static_cast<int>((L.head_bytes / 64 + bs - 1) / bs);  // per token of a region
  for (int item = begin; item < end; ++item) {
    const int b = item / spans, h0 = (item % spans) * span;
    const int nh = Hkv - h0 < span ? Hkv - h0 : span;
    const int ntok = J.lens[b];
    const int32_t* table = J.tables[b];
    const float* qb = J.q + (static_cast<size_t>(b) * J.H + static_cast<size_t>(h0) * G) * D;
    for (int j = 0; j < nh; ++j) {
      ItemState& t = st[j];
      const float* q = qb + static_cast<size_t>(j) * G * D;
      for (int g = 0; g < G; ++g) t.m[g] = -__builtin_inff();
      for (int i = 0; i < G * W; ++i) t.l[i] = 0.0f;
      for (int i = 0; i < G * D; ++i) t.acc[i] = 0.0f;
      for (int i = 0; i < G * ng * W; ++i) t.zacc[i] = 0.0f;
      for (int g = 0; g < G; ++g)
        for (int grp = 0; grp < ng; ++grp) {
          float sum = 0.0f;
          for (int d = 0; d < L.qgroup; ++d) sum += q[g * D + grp * L.qgroup + d];
          t.qsum[g * ng + grp] = sum;
        }
    }
    const int nblk = (ntok + bs - 1) / bs;
    const int nregions = nblk * nh;
    for (int i = 0, r = 0; i < nblk; ++i) {
      const uint8_t* base = J.pool + static_cast<size_t>(table[i]) * L.block_bytes +
                            static_cast<size_t>(h0) * L.head_bytes;
      const int n = ntok - i * bs < bs ? ntok - i * bs : bs;
      for (int j = 0; j < nh; ++j, ++r) {
        Prefetch pf;  // region r + pf_regions, spread over this region's PV token loop
        if (r + pf_regions < nregions) {
          const int ra = r + pf_regions, ia = ra / nh, ja = ra % nh;
          pf.cur = J.pool + static_cast<size_t>(table[ia]) * L.block_bytes +
                   static_cast<size_t>(h0 + ja) * L.head_bytes;
          pf.end = pf.cur + L.head_bytes;
          pf.per_step = pf_lines;
        }
        const uint8_t* head = base + static_cast<size_t>(j) * L.head_bytes;
        const float* q = qb + static_cast<size_t>(j) * G * D;
        for (int g0 = 0; g0 < G; g0 += 8) tile_any(G - g0 < 8 ? G - g0 : 8, L, head, n, q, st[j], g0, ng, pf);
      }
    }
    for (int j = 0; j < nh; ++j) {
      ItemState& t = st[j];
      float* out = J.out + (static_cast<size_t>(b) * J.H + static_cast<size_t>(h0 + j) * G) * D;
      for (int g = 0; g < G; ++g) {
        const float inv = 1.0f / V::hsum(V::load(t.l + g * W));
        for (int grp = 0; grp < ng; ++grp) {
          const float z = V::hsum(V::load(t.zacc + (g * ng + grp) * W));
          for (int d = grp * L.qgroup; d < (grp + 1) * L.qgroup; ++d) t.acc[g * D + d] += z;
        }
        for (int d = 0; d < D; ++d) out[g * D + d] = t.acc[g * D + d] * inv;
      }
    }
  }
}
