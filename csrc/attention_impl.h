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
// of the nibbles with q in 24-bit fixed point (q_limbs), summed exactly in int32.
// The plain float64 version is `reference_attention` in fastdecode/kernels.py.
//
// int4: a stored value is x = scale * u + zero (u in 0..15, per group of channels
// of one token: kg for keys, vg for values). The kernels never materialise x:
//     q . k   = sum_groups  scale_g * (q . u)_g + zero_g * sum_g(q)
//     sum_t p_t v_t = sum_t (p_t * scale_t) u_t  +  sum_t p_t * zero_t   (per group)

typedef V::F F;
constexpr int W = V::W;

// Software prefetch of a later block's head region, spread over the loops of this block
// (a burst of 100+ prefetches would stall on fill buffers).
struct Prefetch {
  const uint8_t* cur = nullptr;  // next line to prefetch; nullptr: nothing to do
  const uint8_t* end = nullptr;
  int per_step = 0;              // lines per step()
  inline void step() {
    for (int i = 0; i < per_step && cur < end; ++i, cur += 64) V::prefetch(cur);
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
template <int GT>
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
      float mx = 0.0f;
      for (int d = 0; d < kg; ++d) mx = std::fabs(x[d]) > mx ? std::fabs(x[d]) : mx;
      float f = mx / 8323072.0f;
      if (!(f >= 1.17549435e-38f)) f = mx > 0.0f ? 1.17549435e-38f : 1.0f;  // subnormal or zero q
      fs[g * ng + grp] = f;
      const float inv = 1.0f / f;
      for (int d = 0; d < kg; ++d) {
        const int32_t Q = static_cast<int32_t>(std::nearbyint(x[d] * inv));
        const int32_t c = ((Q + 128) & 255) - 128, q1 = (Q - c) / 256;
        const int32_t b = ((q1 + 128) & 255) - 128, a = (q1 - b) / 256;
        la[grp * kg + d] = static_cast<int8_t>(a);
        lb[grp * kg + d] = static_cast<int8_t>(b);
        lc[grp * kg + d] = static_cast<int8_t>(c);
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
#endif

// Online softmax over one chunk of blocks for the GT heads of a tile; the heads are
// independent, so their reductions overlap. P[g * ps + 0..n) holds scores in log2
// units (-inf where no token is); on return 2^(s - m_new), with zeros up to the next
// multiple of W.
// m[g] is the running max, l[g * W ..] the running sum as W lanes, and
// corr[g] the factor the accumulators of head g must be scaled by.
template <int GT>
static void softmax_tile(float* P, int ps, int n, float* m, float* l, float* corr) {
  const int nr = (n + W - 1) / W * W;
  float m_new[GT];
  for (int g = 0; g < GT; ++g) {
    float* p = P + g * ps;
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
    float* p = P + g * ps;
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

// The MHA case (one query head), in named registers (arrays were spilled): four runs of W
// nibble bytes of a token in flight, each the low and high channels of one group, so that it does
// not depend on the group size. Needs (D / 2) % (4 * W) == 0 and half % W == 0.
template <int QG>
static void pv_int4_mha(int D, int half_rt, int bsp, int n, const uint8_t* Vn, const float* Cc, float* acc,
                        Prefetch& pf_io) {
  Prefetch pf = pf_io;  // a local copy stays in registers
  const int half = QG ? QG / 2 : half_rt, qg = 2 * half;
  for (int o = 0; o < D / 2; o += 4 * W) {
    float* a[4];  // the low channels of run r; its high channels are half further
    const float* c[4];
    for (int r = 0; r < 4; ++r) {
      const int grp = (o + r * W) / half, i = (o + r * W) % half;
      a[r] = acc + grp * qg + i;
      c[r] = Cc + grp * bsp;
    }
    F l0 = V::load(a[0]), h0 = V::load(a[0] + half), l1 = V::load(a[1]), h1 = V::load(a[1] + half);
    F l2 = V::load(a[2]), h2 = V::load(a[2] + half), l3 = V::load(a[3]), h3 = V::load(a[3] + half);
    const float *c0 = c[0], *c1 = c[1], *c2 = c[2], *c3 = c[3];
    const uint8_t* src = Vn + o;
    for (int t = 0; t < n; ++t, src += D / 2) {
      if (pf.per_step <= 3 && pf.cur + 3 * 64 <= pf.end) {  // the common case, unrolled (6% faster)
        V::prefetch(pf.cur);
        V::prefetch(pf.cur + 64);
        V::prefetch(pf.cur + 128);
        pf.cur += 3 * 64;
      } else {
        pf.step();
      }
      F lo, hi, k;
      V::nib(src, lo, hi);
      k = V::set1(c0[t]); l0 = V::fma(k, lo, l0); h0 = V::fma(k, hi, h0);
      V::nib(src + W, lo, hi);
      k = V::set1(c1[t]); l1 = V::fma(k, lo, l1); h1 = V::fma(k, hi, h1);
      V::nib(src + 2 * W, lo, hi);
      k = V::set1(c2[t]); l2 = V::fma(k, lo, l2); h2 = V::fma(k, hi, h2);
      V::nib(src + 3 * W, lo, hi);
      k = V::set1(c3[t]); l3 = V::fma(k, lo, l3); h3 = V::fma(k, hi, h3);
    }
    V::store(a[0], l0); V::store(a[0] + half, h0); V::store(a[1], l1); V::store(a[1] + half, h1);
    V::store(a[2], l2); V::store(a[2] + half, h2); V::store(a[3], l3); V::store(a[3] + half, h3);
  }
  pf_io = pf;
}

template <int GT, int GC, int QG>
static void pv_int4_groups(int D, int ng, int half_rt, int bsp, int n, const uint8_t* Vn, const float* Cc, float* acc,
                           Prefetch& pf_io) {
  Prefetch pf = pf_io;  // a local copy stays in registers
  const int half = QG ? QG / 2 : half_rt, qg = 2 * half;
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
static void pv_int4(const Layout& L, const uint8_t* head, int n, const float* P, int ps, float* Cc, float* acc,
                    float* zacc, Prefetch& pf) {
  const int D = L.head_dim, bsp = L.bsp, qg = L.vgroup, ng = D / qg, half = qg / 2;
  const uint8_t* Vn = head + L.v_off;
  const uint16_t* Vs = reinterpret_cast<const uint16_t*>(head + L.vs_off);
  const uint16_t* Vz = reinterpret_cast<const uint16_t*>(head + L.vz_off);
  const int nr = (n + W - 1) / W * W;  // P is zero on [n, nr)
  for (int grp = 0; grp < ng; ++grp)
    for (int c0 = 0; c0 < nr; c0 += W) {
      const F sc = V::load_h(Vs + grp * bsp + c0), zr = V::load_h(Vz + grp * bsp + c0);  // once for the GT heads
      for (int g = 0; g < GT; ++g) {
        const F p = V::load(P + g * ps + c0);
        V::store(Cc + (g * ng + grp) * bsp + c0, V::mul(p, sc));
        float* z = zacc + (g * ng + grp) * W;
        V::store(z, V::fma(p, zr, V::load(z)));
      }
    }
  if (GT == 1 && (D / 2) % (4 * W) == 0 && half % W == 0)
    return pv_int4_mha<QG>(D, half, bsp, n, Vn, Cc, acc, pf);
  constexpr int GC = GT == 1 ? 4 : (GT == 2 ? 2 : 1);  // groups in flight: >= 8 FMA chains
  if (ng % GC == 0)
    pv_int4_groups<GT, GC, QG>(D, ng, half, bsp, n, Vn, Cc, acc, pf);
  else
    pv_int4_groups<GT, 1, QG>(D, ng, half, bsp, n, Vn, Cc, acc, pf);
}

// Running state of the rows (query heads) of an item: row rho = j * G + g is query head g
// of the item's j-th kv head. P holds the scores / probabilities of the tile (<= 8 rows) in work.
struct ItemState {
  float *m, *l, *qsum, *acc, *zacc, *P, *Cc, *fs;
  int32_t* limbs;  // integer path only: q of each row in fixed point (q_limbs)
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

// Bytes ahead the kernel prefetches, in the order it reads (RegionWalk). A region is 8 KiB
// at fp16 and 2.5 KiB at int4 (D=128); int4 regions are small, so their successors must be
// requested earlier. Measured (1 thread, Zen 5): fp16 best at 4-8 KiB ahead (16 KiB and more
// is slower); int4 (chunks of 4 blocks) 5% slower at 12 KiB, and at 24 KiB it fell to 0.65x
// in some runs.
constexpr size_t kPrefetchBytesFp16 = 8192, kPrefetchBytesInt4 = 16384;

// The regions of an item in read order (chunks of NB blocks; inside a chunk, head by head,
// and each head's blocks in turn), walked pf_regions ahead of the kernel for its software
// prefetch: next() is the region to prefetch while the kernel does the P V of the current one.
struct RegionWalk {
  const Layout* L;
  const Layout* T;  // fp16 tails (AttnJob::T)
  const uint8_t* pool;
  const int32_t* table;
  int h0, nh, nblk, NB;
  int i0 = 0, j = 0, c = 0;  // the cursor: chunk start, head, block in chunk
  const uint8_t* at(int blk, int head) const {
    return pool + static_cast<size_t>(table[blk]) * L->block_bytes + static_cast<size_t>(h0 + head) * L->head_bytes;
  }
  __attribute__((always_inline)) inline void advance() {
    const int nb = nblk - i0 < NB ? nblk - i0 : NB;
    if (++c < nb) return;
    c = 0;
    if (++j < nh) return;
    j = 0;
    i0 += NB;
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

// One chunk (blocks i0 .. i0 + nb) of GT rows from rho, all of kv head j: the scores of every
// block, one softmax update, then P V block by block, prefetching from pfw (if given).
template <int GT, int KG, int VG>
static void chunk_tile(const RegionWalk& w, int i0, int nb, int j, int ntok, const float* q, const ItemState& st,
                       int rho, int nkg, int nvg, int ps, RegionWalk* pfw, int pf_lines, const uint8_t* tail) {
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
  const int NB = L.int4 ? kChunkBlocksInt4 : kChunkBlocksFp16, ps = NB * bsp;  // ps: P row stride
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
  const size_t pf_bytes = L.int4 ? kPrefetchBytesInt4 : kPrefetchBytesFp16;
  const int pf_regions = static_cast<int>((pf_bytes + L.head_bytes - 1) / L.head_bytes);
  const int pf_lines = static_cast<int>((L.head_bytes / 64 + bs - 1) / bs);  // per token of a region
  for (int item = begin; item < end; ++item) {
    const int b = item / spans, h0 = (item % spans) * span;
    const int nh = Hkv - h0 < span ? Hkv - h0 : span;
    const int ntok = J.lens[b];
    const int32_t* table = J.tables[b];
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
    const RegionWalk walk{&L, J.T, J.pool, table, h0, nh, nblk, NB};
    const int32_t tb = J.tails ? J.tails[b] : -1;
    const uint8_t* tail0 = tb >= 0 ? J.tail_pool + static_cast<size_t>(tb) * J.T->block_bytes : nullptr;
    RegionWalk ahead = walk;
    for (int i = 0; i < pf_regions; ++i) ahead.advance();
    for (int i0 = 0; i0 < nblk; i0 += NB) {
      const int nb = nblk - i0 < NB ? nblk - i0 : NB;
      for (int j = 0; j < nh; ++j)
        for (int g0 = 0; g0 < G; g0 += 8) {  // tiles of at most 8 rows (all of them, for G <= 8)
          const int rho = j * G + g0;
          const float* q = qb + static_cast<size_t>(rho) * D;
          const uint8_t* tail = tail0 ? tail0 + static_cast<size_t>(h0 + j) * J.T->head_bytes : nullptr;
#define FD_CALL(T) chunk_tile<T, KG, VG>(walk, i0, nb, j, ntok, q, st, rho, nkg, nvg, ps, g0 == 0 ? &ahead : nullptr, pf_lines, tail)
          FD_TILE_SWITCH(G - g0 < 8 ? G - g0 : 8, FD_CALL)
#undef FD_CALL
        }
    }
    for (int rho = 0; rho < nrows; ++rho) {
      float* out = J.out + (static_cast<size_t>(b) * J.H + static_cast<size_t>(h0) * G + rho) * D;
      float* acc = st.acc + rho * D;
      const float inv = 1.0f / V::hsum(V::load(st.l + rho * W));
      for (int grp = 0; grp < nvg; ++grp) {
        const float z = V::hsum(V::load(st.zacc + (rho * nvg + grp) * W));
        for (int d = grp * L.vgroup; d < (grp + 1) * L.vgroup; ++d) acc[d] += z;
      }
      for (int d = 0; d < D; ++d) out[d] = acc[d] * inv;
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
