// Paged attention over an int8 or int4 KV cache on the CPU (vec.h / vec_int.h: AVX-512, AVX2 or generic; the
// store: kv_quant_store.cpp):
// the same work items, tiles, online softmax (with the same optional logit soft-cap, a template parameter)
// and batch invariance as paged_attention.cpp, with integer dot products on both sides of the softmax.
//
// Must equal: kernels/reference/attention.py (`paged_attention_torch`, with its `window` and `softcap`) over the same
//             codes dequantized (kernels/reference/kv_quant.py), within the rounding below.
// Tested by:  tests/kernels/test_native_kv_quant.py (round trips, attention against the reference with and without
//             the soft-cap, head_dim 64-256, bitwise batch invariance, jobs with int8/int4 KV; on every
//             instruction-set path this CPU runs, bitwise the same on each; the AVX-512 path compiled anywhere).
//
// Q.K: each query row is quantized once per work item to two int8 parts (QQuery below), K codes are
// stored unsigned (code + 128 for int8, code + 8 for int4), and vpdpbusd adds 4 u8 x s8 products per
// lane: 16 keys x 4 dims per step, exact in int32. The offset is taken out with the row's code sum
// (sum (k + o) q = sum k q + o sum q), then score = q_scale * k_scale * dot, per scale group.
// P.V: P times each key's V scale is rounded to 15 bits (Tile below), V codes are widened to int16 pairs
// and vpdpwssd adds 2 keys' products per lane, exact in int32; the tile's sum goes into the fp32
// accumulators with its unit. Measured error and speed: docs/benchmarks.md.
// vpdpbusd and vpdpwssd are vec_int.h's dpbusd and dpwssd: the instructions where the CPU has VNNI (AVX512-VNNI,
// AVX-VNNI), exact emulations elsewhere (vpmaddwd over widened bytes; vpmaddwd + vpaddd), so every path gives the
// same integers, and the fp32 steps around them are the same operations in the same order: the same bits.
//
// Layouts: kv_quant_layout.h. Compiled per model with -DHEAD_DIM=D -DGQA=G -DGROUP=<int4 values per scale>
// (kernels/native/ops.py).

#include "kv_quant_layout.h"

namespace {

// A query row quantized for vpdpbusd in two int8 parts, q ~ scale * (hi + lo / 254): hi = round(q / scale),
// lo = round((q / scale - hi) * 254), ~16 bits in all; with the sums of each part's codes per K scale group.
// Measured against the reference over the same dequantized cache (fp32, SmolLM2 shapes): mean error 6e-6
// with both parts, 9e-4 with hi alone (QPARTS=1, which prefills ~14% faster; decode is about even).
#ifndef QPARTS
#define QPARTS 2
#endif
constexpr int QP = QPARTS;
struct QQuery {
  alignas(64) int8_t code[QP][D];
  float scale;
  int32_t offset[D / 16];  // per K scale group: 128 x (254 x sum of hi codes + sum of lo codes), K's code offset
};

inline uint32_t quad(const int8_t* p) {  // 4 codes as one dword, as in memory
  uint32_t x;
  memcpy(&x, p, 4);
  return x;
}

template <typename T>
void quantize_query(const T* q, int groups, QQuery* out) {
  vf x[D / 16];
  vf amax = vzero();
  for (int i = 0; i < D / 16; ++i) {
    x[i] = vload(q + 16 * i);
    amax = vmax(amax, vabs(x[i]));
  }
  const float m = reduce_max(amax);
  out->scale = m / 127.0f;
  const vf inv = vset(m > 0 ? 127.0f / m : 0.0f);
  const int per = D / 16 / groups;
  for (int g = 0; g < groups; ++g) {
    vi sum[QP];
    for (int p = 0; p < QP; ++p) sum[p] = iset(0);
    for (int i = g * per; i < (g + 1) * per; ++i) {  // |y| <= 127, |rest| <= 127: the int8 stores do not saturate
      const vf y = x[i] * inv;
      const vi hi = to_int_trunc(round_even(y));
      store_i8(out->code[0] + 16 * i, hi);
      sum[0] = sum[0] + hi;
      if constexpr (QP == 2) {
        const vf rest = (y - to_float(hi)) * vset(254.0f);
        const vi lo = to_int_trunc(round_even(rest));
        store_i8(out->code[QP - 1] + 16 * i, lo);
        sum[QP - 1] = sum[QP - 1] + lo;
      }
    }
    out->offset[g] = 128 * (QP == 2 ? 254 * reduce_add(sum[0]) + reduce_add(sum[QP - 1]) : reduce_add(sum[0]));
  }
}

// A tile of 16 keys as the dot products read it, unpacked once for all the rows that see it: K as u8 quads
// (code + 128: int8 in place, int4 widened into k4), V widened to int16 pairs (keys 2jj, 2jj + 1) per dim.
// P.V's integer step: p (<= 1 after the online max) times key j's V scale is taken in units of the largest
// V scale among the keys a row sees in this tile / 32767, so it fits 15 bits. For a row that sees the whole
// tile that is the tile's own (`p_to_int`: the factors per group, `unit`: the unit), shared by all such
// rows; a row on its causal diagonal or window edge takes the max over the keys it sees (not a later
// token's, nor a block's stale slot): either way a row's numbers depend only on its own keys.
struct Tile {
  const uint8_t* k;  // quad o of the tile's keys at k + o * kstride
  int64_t kstride;
  const uint16_t* ks;  // K scales of group g at ks + g * bs
  int bs;
  alignas(64) uint8_t k4[D / 4][64];
  const uint8_t* v_raw;  // the tile's packed V codes
  alignas(64) int16_t v16[TILE / 2][D][2];  // ... widened, once a tile has more than one row group
  vf vscale[D / 16];  // V scales per group, fp32
  vf p_to_int[D / 16];
  float unit[D / 16];
};

inline void p_factors(vf vsg, vf* factor, float* unit) {
  const float top = reduce_max(vsg);
  *factor = vsg * vset(top > 0 ? 32767.0f / top : 0.0f);
  *unit = top / 32767.0f;
}

// K scales' and V's per-tile parts; V itself stays packed (v_raw) until a second row group needs it.
template <int BITS>
void unpack_tile(const uint8_t* k, const uint8_t* v, const uint16_t* vs, bool full, Tile* t) {
  constexpr int NG = scale_groups<BITS>();
  for (int g = 0; g < NG; ++g) {
    t->vscale[g] = vload_fp16(vs + g * t->bs);
    if (full) p_factors(t->vscale[g], &t->p_to_int[g], &t->unit[g]);  // some row sees every key of the tile
  }
  t->v_raw = v;
  if constexpr (BITS == 8) {
    t->k = k;
    t->kstride = (int64_t)t->bs * 4;
  } else {
    for (int o = 0; o < D / 8; ++o) {  // code + 8 -> code + 128
      const vb x = bload(k + (int64_t)o * t->bs * 4);
      bstore(t->k4[2 * o], add_bytes(low_nibbles(x), 120));
      bstore(t->k4[2 * o + 1], add_bytes(high_nibbles(x), 120));
    }
    t->k = t->k4[0];
    t->kstride = 64;
  }
}

// V codes of key pair jj, dims 16i..16i+15, as int16 pairs: from the packed cache or from v16.
template <int BITS, bool RAW>
inline vw v_pairs(const Tile& t, int jj, int i) {
  if constexpr (!RAW) {
    return wload(&t.v16[jj][16 * i][0]);
  } else if constexpr (BITS == 8) {
    return widen_s8((const int8_t*)t.v_raw + (jj * D + 16 * i) * 2);
  } else {  // quad jj / 2; low nibbles hold pair 2m, high ones pair 2m + 1
    return widen_nibbles(t.v_raw + ((jj / 2) * D + 16 * i) * 2, jj % 2 ? 4 : 0);
  }
}

template <int BITS>
void unpack_v(Tile* t) {
  for (int jj = 0; jj < TILE / 2; ++jj)
    for (int i = 0; i < NACC; ++i) wstore(&t->v16[jj][16 * i][0], v_pairs<BITS, true>(*t, jj, i));
}

// P.V's loop order and the rows computed together (QRB; neither changes a bit of a row's result). AVX-512: key
// pairs outer, RB rows (attention_common.h: the N x NACC accumulators fit in the 32 zmm). AVX2 and generic: dims
// outer, so that only one dim's N accumulators are live (AVX2's 16 ymm hold 8 vectors), and on AVX2 4 rows, which
// takes a decode's whole GQA group (SmolLM2: 3 rows) in one pass: ~12% faster than 2 + 1 rows, measured on Zen 3.
#if defined(BJ_ISA_AVX512)
constexpr bool PV_KEYS_OUTER = true;
#else
constexpr bool PV_KEYS_OUTER = false;
#endif
#if defined(BJ_ISA_AVX2)
constexpr int QRB = 4;
#else
constexpr int QRB = RB;
#endif

// One tile for N rows (N <= QRB).
template <int BITS>
struct Quant {
  static constexpr int NG = scale_groups<BITS>();
  static constexpr int V_GROUP_VECS = NACC / NG;        // 16-dim accumulator vectors per scale group

  template <int N, bool RAW, bool CAP>
  static void attend(const Tile& t, int t0, Row* const* rows, Logits L) {
    const QQuery* qq[N];
    vf s[N];
    for (int r = 0; r < N; ++r) {
      qq[r] = (const QQuery*)rows[r]->q;
      s[r] = vzero();
    }
    // Q.K, one scale group at a time, groups summed in order
    for (int g = 0; g < NG; ++g) {
      vi dot[N][QP];
      for (int r = 0; r < N; ++r)
        for (int p = 0; p < QP; ++p) dot[r][p] = iset(0);
      for (int o = g * (D / 4 / NG); o < (g + 1) * (D / 4 / NG); ++o) {
        const vb kq = bload(t.k + o * t.kstride);
        for (int r = 0; r < N; ++r)
          for (int p = 0; p < QP; ++p) dot[r][p] = dpbusd(dot[r][p], kq, bset(quad(qq[r]->code[p] + 4 * o)));
      }
      const vf ksg = vload_fp16(t.ks + g * t.bs);
      for (int r = 0; r < N; ++r) {  // hi * 254 + lo - offset, exact in int32 (|hi.k| < 2^22 at D = 256)
        vi exact = dot[r][0];
        if constexpr (QP == 2) exact = exact * iset(254) + dot[r][1];
        exact = exact - iset(qq[r]->offset[g]);
        s[r] = fmadd(to_float(exact), ksg, s[r]);
      }
    }
    for (int r = 0; r < N; ++r) s[r] = s[r] * vset(QP == 2 ? qq[r]->scale / 254.0f : qq[r]->scale);
    float alpha[N];
    softmax_rows<N, CAP>(s, rows, t0, L, alpha);

    // P x V scale, per group, to 15-bit integers in key pairs (masked keys: p = 0)
    alignas(64) uint32_t pw[N][NG][TILE / 2];
    float unit[N][NG];
    for (int r = 0; r < N; ++r) {
      const m16 seen = key_mask(t0, *rows[r]);
      for (int g = 0; g < NG; ++g) {
        vf factor;
        if (seen == ALL) {  // the tile's own factors (set: some row sees the whole tile)
          factor = t.p_to_int[g];
          unit[r][g] = t.unit[g];
        } else {
          p_factors(keep(seen, t.vscale[g]), &factor, &unit[r][g]);
        }
        store_i16((int16_t*)pw[r][g], to_int_trunc(round_even(s[r] * factor)));  // in [0, 32767]
      }
    }
    // each pv[r][i] adds its key pairs in order, whichever loop is outer (PV_KEYS_OUTER)
    vi pv[N][NACC];
    for (int r = 0; r < N; ++r)
      for (int i = 0; i < NACC; ++i) pv[r][i] = iset(0);
    if constexpr (PV_KEYS_OUTER) {
      for (int jj = 0; jj < TILE / 2; ++jj)
        for (int i = 0; i < NACC; ++i) {
          const vw vv = v_pairs<BITS, RAW>(t, jj, i);
          for (int r = 0; r < N; ++r) pv[r][i] = dpwssd(pv[r][i], vv, wset(pw[r][i / V_GROUP_VECS][jj]));
        }
    } else {
      for (int i = 0; i < NACC; ++i)
        for (int jj = 0; jj < TILE / 2; ++jj) {
          const vw vv = v_pairs<BITS, RAW>(t, jj, i);
          for (int r = 0; r < N; ++r) pv[r][i] = dpwssd(pv[r][i], vv, wset(pw[r][i / V_GROUP_VECS][jj]));
        }
    }
    for (int r = 0; r < N; ++r) {
      const vf a = vset(alpha[r]);
      for (int i = 0; i < NACC; ++i) {
        const vf prev = vload(rows[r]->acc + 16 * i) * a;
        vstore(rows[r]->acc + 16 * i, fmadd(to_float(pv[r][i]), vset(unit[r][i / V_GROUP_VECS]), prev));
      }
    }
  }
};

// Rows in groups of QRB; V is widened into the tile once when more than one group reads it (the same
// values either way: the result does not depend on it).
template <int BITS, bool CAP>
inline void attend_rows(Tile& t, int t0, Row* const* rows, int count, Logits L) {
  using Q = Quant<BITS>;
  if (count <= QRB) {
    switch (count) {
      case 4: if constexpr (QRB == 4) Q::template attend<4, true, CAP>(t, t0, rows, L); break;
      case 3: if constexpr (QRB >= 3) Q::template attend<3, true, CAP>(t, t0, rows, L); break;
      case 2: if constexpr (QRB >= 2) Q::template attend<2, true, CAP>(t, t0, rows, L); break;
      case 1: Q::template attend<1, true, CAP>(t, t0, rows, L); break;
      default: break;
    }
    return;
  }
  unpack_v<BITS>(&t);
  for (; count >= QRB; count -= QRB, rows += QRB) Q::template attend<QRB, false, CAP>(t, t0, rows, L);
  switch (count) {  // the rest, 1..QRB-1 rows
    case 3: if constexpr (QRB > 3) Q::template attend<3, false, CAP>(t, t0, rows, L); break;
    case 2: if constexpr (QRB > 2) Q::template attend<2, false, CAP>(t, t0, rows, L); break;
    case 1: if constexpr (QRB > 1) Q::template attend<1, false, CAP>(t, t0, rows, L); break;
    default: break;
  }
}

struct Scales {
  const uint16_t* k;
  const uint16_t* v;
};

// One work item: query tokens [tb, te) of row `row`, KV head h (as paged_attention.cpp's run_item).
template <int BITS, typename T, bool CAP>
void run_item(const Args& A, const Scales& S, int row, int h, int tb, int te) {
  using Q = Quant<BITS>;
  const int bs = A.block_size;
  const int32_t* table = A.block_tables + (int64_t)row * A.max_blocks;
  const int64_t code_bytes = (int64_t)bs * D * BITS / 8;  // K or V codes of one (block, KV head)
  const int64_t scale_elems = (int64_t)bs * Q::NG;

  alignas(64) float acc[MAX_ROWS][D];
  QQuery query[MAX_ROWS];
  Row rows[MAX_ROWS];
  int klo, khi;
  const int nrows = init_rows(A, row, h, tb, te, rows, acc, &klo, &khi, [&](int r, int t, int head) {
    quantize_query((const T*)A.q + t * A.q_token_stride + (int64_t)head * D, Q::NG, &query[r]);
    return (const void*)&query[r];
  });
  const uint8_t* kc = (const uint8_t*)A.k_cache;
  const uint8_t* vc = (const uint8_t*)A.v_cache;
  auto head_block = [&](int t0) { return (int64_t)table[t0 / bs] * A.num_kv_heads + h; };
  // within a block, a tile at offset off starts off * 4 bytes into each K line, off * D * BITS / 8 bytes
  // into V, off scales into each scale group
  constexpr int k_lines = BITS == 8 ? D / 4 : D / 8;
  Row* active[MAX_ROWS];
  Tile tile;
  tile.bs = bs;
  for (int t0 = klo / TILE * TILE; t0 < khi; t0 += TILE) {
    if (t0 + TILE < khi) {  // the next tile into L2 while this one is computed (see paged_attention.cpp)
      const int tn = t0 + TILE, o = tn % bs;
      const int64_t b = head_block(tn);
      for (int i = 0; i < k_lines; ++i) prefetch_l2(kc + b * code_bytes + ((int64_t)i * bs + o) * 4);
      prefetch_l2(vc + b * code_bytes + (int64_t)o * D * BITS / 8, TILE * D * BITS / 8);
      for (int g = 0; g < Q::NG; ++g) {
        prefetch_l2(S.k + b * scale_elems + (int64_t)g * bs + o);
        prefetch_l2(S.v + b * scale_elems + (int64_t)g * bs + o);
      }
    }
    int count = 0;
    for (int r = 0; r < nrows; ++r)
      if (rows[r].hi > t0 && rows[r].lo < t0 + TILE) active[count++] = &rows[r];
    const int off = t0 % bs;
    const int64_t b = head_block(t0);
    tile.ks = S.k + b * scale_elems + off;
    bool full = false;
    for (int r = 0; r < count && !full; ++r) full = key_mask(t0, *active[r]) == 0xffff;
    unpack_tile<BITS>(kc + b * code_bytes + off * 4, vc + b * code_bytes + (int64_t)off * D * BITS / 8,
                      S.v + b * scale_elems + off, full, &tile);
    attend_rows<BITS, CAP>(tile, t0, active, count, A.logits);
  }
  T* out = (T*)A.out;
  for (int r = 0; r < nrows; ++r) {
    const int t = tb + r / G, head = h * G + r % G;
    store_row(acc[r], 1.0f / rows[r].l, out + ((int64_t)t * A.num_heads + head) * D);
  }
}

}  // namespace

extern "C" {

// bits 8 or 4; dtype of q and out: 0 = fp32, 1 = bf16; softcap: the logit soft-cap (0 = none); key_ends as
// bj_paged_attention's. Returns 0, or
// < 0 for arguments it does not take.
int bj_paged_attention_quant(const void* q, int64_t q_token_stride, void* out, const void* k_codes, const void* v_codes,
                             const void* k_scales, const void* v_scales, const int32_t* block_tables, int max_blocks,
                             const int32_t* seq_lens, const int32_t* query_start_loc, int num_rows, int num_heads,
                             int num_kv_heads, int block_size, int window, float scale, float softcap, int bits,
                             int dtype, int num_threads, const int32_t* key_ends) {
  if (num_heads != num_kv_heads * G || block_size % TILE != 0 || softcap < 0) return -2;
  Args A{q, out, k_codes, v_codes, block_tables, seq_lens, query_start_loc, q_token_stride,
         max_blocks, num_heads, num_kv_heads, block_size, window, Logits::make(scale, softcap), key_ends};
  const Scales S{(const uint16_t*)k_scales, (const uint16_t*)v_scales};
  auto go = [&](auto bits_tag, auto type_tag) {
    constexpr int B = decltype(bits_tag)::value;
    using T = typename decltype(type_tag)::type;
    if (A.logits.capped())
      for_each_item(A, num_rows, num_threads, [&](int row, int h, int tb, int te) { run_item<B, T, true>(A, S, row, h, tb, te); });
    else
      for_each_item(A, num_rows, num_threads, [&](int row, int h, int tb, int te) { run_item<B, T, false>(A, S, row, h, tb, te); });
  };
  using I8 = std::integral_constant<int, 8>;
  using I4 = std::integral_constant<int, 4>;
  using F = std::common_type<float>;
  using H = std::common_type<uint16_t>;
  if (bits == 8 && dtype == 0) {
    go(I8{}, F{});
  } else if (bits == 4 && dtype == 0) {
    go(I4{}, F{});
  } else if (bits == 8 && dtype == 1) {
    go(I8{}, H{});
  } else if (bits == 4 && dtype == 1) {
    go(I4{}, H{});
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
