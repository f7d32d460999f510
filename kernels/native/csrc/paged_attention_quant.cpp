// Paged attention over an int8 or int4 KV cache on the CPU (AVX-512 VNNI) (the store: kv_quant_store.cpp):
// the same work items, tiles, online softmax (with the same optional logit soft-cap, a template parameter)
// and batch invariance as paged_attention.cpp, with integer dot products on both sides of the softmax.
//
// Must equal: kernels/reference/attention.py (`paged_attention_torch`, with its `window` and `softcap`) over the same
//             codes dequantized (kernels/reference/kv_quant.py), within the rounding below.
// Tested by:  tests/kernels/test_native_kv_quant.py (round trips, attention against the reference with and without
//             the soft-cap, head_dim 64-256, bitwise batch invariance, jobs with int8/int4 KV).
//
// Q.K: each query row is quantized once per work item to two int8 parts (QQuery below), K codes are
// stored unsigned (code + 128 for int8, code + 8 for int4), and vpdpbusd adds 4 u8 x s8 products per
// lane: 16 keys x 4 dims per instruction, exact in int32. The offset is taken out with the row's code sum
// (sum (k + o) q = sum k q + o sum q), then score = q_scale * k_scale * dot, per scale group.
// P.V: P times each key's V scale is rounded to 15 bits (Tile below), V codes are widened to int16 pairs
// and vpdpwssd adds 2 keys' products per lane, exact in int32; the tile's sum goes into the fp32
// accumulators with its unit. Measured error and speed: docs/benchmarks.md.
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

template <typename T>
void quantize_query(const T* q, int groups, QQuery* out) {
  __m512 x[D / 16];
  __m512 amax = _mm512_setzero_ps();
  for (int i = 0; i < D / 16; ++i) {
    x[i] = load16(q + 16 * i);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(x[i]));
  }
  const float m = _mm512_reduce_max_ps(amax);
  out->scale = m / 127.0f;
  const __m512 inv = _mm512_set1_ps(m > 0 ? 127.0f / m : 0.0f);
  const int per = D / 16 / groups;
  constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int g = 0; g < groups; ++g) {
    __m512i sum[QP];
    for (int p = 0; p < QP; ++p) sum[p] = _mm512_setzero_si512();
    for (int i = g * per; i < (g + 1) * per; ++i) {
      const __m512 y = _mm512_mul_ps(x[i], inv);
      const __m512i hi = _mm512_cvt_roundps_epi32(y, R);
      _mm_store_si128((__m128i*)(out->code[0] + 16 * i), _mm512_cvtsepi32_epi8(hi));
      sum[0] = _mm512_add_epi32(sum[0], hi);
      if constexpr (QP == 2) {
        const __m512 rest = _mm512_mul_ps(_mm512_sub_ps(y, _mm512_cvtepi32_ps(hi)), _mm512_set1_ps(254.0f));
        const __m512i lo = _mm512_cvt_roundps_epi32(rest, R);
        _mm_store_si128((__m128i*)(out->code[QP - 1] + 16 * i), _mm512_cvtsepi32_epi8(lo));
        sum[QP - 1] = _mm512_add_epi32(sum[QP - 1], lo);
      }
    }
    out->offset[g] = 128 * (QP == 2 ? 254 * _mm512_reduce_add_epi32(sum[0]) + _mm512_reduce_add_epi32(sum[QP - 1])
                                    : _mm512_reduce_add_epi32(sum[0]));
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
  __m512 vscale[D / 16];  // V scales per group, fp32
  __m512 p_to_int[D / 16];
  float unit[D / 16];
};

inline void p_factors(__m512 vsg, __m512* factor, float* unit) {
  const float vmax = _mm512_reduce_max_ps(vsg);
  *factor = _mm512_mul_ps(vsg, _mm512_set1_ps(vmax > 0 ? 32767.0f / vmax : 0.0f));
  *unit = vmax / 32767.0f;
}

// K scales' and V's per-tile parts; V itself stays packed (v_raw) until a second row group needs it.
template <int BITS>
void unpack_tile(const uint8_t* k, const uint8_t* v, const uint16_t* vs, bool full, Tile* t) {
  constexpr int NG = scale_groups<BITS>();
  for (int g = 0; g < NG; ++g) {
    t->vscale[g] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(vs + g * t->bs)));
    if (full) p_factors(t->vscale[g], &t->p_to_int[g], &t->unit[g]);  // some row sees every key of the tile
  }
  t->v_raw = v;
  if constexpr (BITS == 8) {
    t->k = k;
    t->kstride = (int64_t)t->bs * 4;
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F), to_u8 = _mm512_set1_epi8(120);  // code + 8 -> code + 128
    for (int o = 0; o < D / 8; ++o) {
      const __m512i x = _mm512_loadu_si512(k + (int64_t)o * t->bs * 4);
      _mm512_store_si512(t->k4[2 * o], _mm512_add_epi8(_mm512_and_si512(x, low), to_u8));
      _mm512_store_si512(t->k4[2 * o + 1], _mm512_add_epi8(_mm512_and_si512(_mm512_srli_epi16(x, 4), low), to_u8));
    }
    t->k = t->k4[0];
    t->kstride = 64;
  }
}

// V codes of key pair jj, dims 16i..16i+15, as int16 pairs: from the packed cache or from v16.
template <int BITS, bool RAW>
inline __m512i v_pairs(const Tile& t, int jj, int i) {
  if constexpr (!RAW) {
    return _mm512_load_si512(&t.v16[jj][16 * i][0]);
  } else if constexpr (BITS == 8) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(t.v_raw + (jj * D + 16 * i) * 2)));
  } else {  // quad jj / 2; low nibbles hold pair 2m, high ones pair 2m + 1
    __m256i x = _mm256_loadu_si256((const __m256i*)(t.v_raw + ((jj / 2) * D + 16 * i) * 2));
    if (jj % 2) x = _mm256_srli_epi16(x, 4);
    return _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(x, _mm256_set1_epi8(0x0F))), _mm512_set1_epi16(8));
  }
}

template <int BITS>
void unpack_v(Tile* t) {
  for (int jj = 0; jj < TILE / 2; ++jj)
    for (int i = 0; i < NACC; ++i) _mm512_store_si512(&t->v16[jj][16 * i][0], v_pairs<BITS, true>(*t, jj, i));
}

// One tile for N rows (N <= RB).
template <int BITS>
struct Quant {
  static constexpr int NG = scale_groups<BITS>();
  static constexpr int V_GROUP_VECS = NACC / NG;        // 16-dim accumulator vectors per scale group

  template <int N, bool RAW, bool CAP>
  static void attend(const Tile& t, int t0, Row* const* rows, Logits L) {
    const int32_t* qd[N][QP];
    const QQuery* qq[N];
    __m512 s[N];
    for (int r = 0; r < N; ++r) {
      qq[r] = (const QQuery*)rows[r]->q;
      for (int p = 0; p < QP; ++p) qd[r][p] = (const int32_t*)qq[r]->code[p];
      s[r] = _mm512_setzero_ps();
    }
    // Q.K, one scale group at a time, groups summed in order
    for (int g = 0; g < NG; ++g) {
      __m512i dot[N][QP];
      for (int r = 0; r < N; ++r)
        for (int p = 0; p < QP; ++p) dot[r][p] = _mm512_setzero_si512();
      for (int o = g * (D / 4 / NG); o < (g + 1) * (D / 4 / NG); ++o) {
        const __m512i kq = _mm512_loadu_si512(t.k + o * t.kstride);
        for (int r = 0; r < N; ++r)
          for (int p = 0; p < QP; ++p) dot[r][p] = _mm512_dpbusd_epi32(dot[r][p], kq, _mm512_set1_epi32(qd[r][p][o]));
      }
      const __m512 ksg = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(t.ks + g * t.bs)));
      for (int r = 0; r < N; ++r) {  // hi * 254 + lo - offset, exact in int32 (|hi.k| < 2^22 at D = 256)
        __m512i exact = dot[r][0];
        if constexpr (QP == 2) exact = _mm512_add_epi32(_mm512_mullo_epi32(exact, _mm512_set1_epi32(254)), dot[r][1]);
        exact = _mm512_sub_epi32(exact, _mm512_set1_epi32(qq[r]->offset[g]));
        s[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), ksg, s[r]);
      }
    }
    for (int r = 0; r < N; ++r) s[r] = _mm512_mul_ps(s[r], _mm512_set1_ps(QP == 2 ? qq[r]->scale / 254.0f : qq[r]->scale));
    float alpha[N];
    softmax_rows<N, CAP>(s, rows, t0, L, alpha);

    // P x V scale, per group, to 15-bit integers in key pairs (masked keys: p = 0)
    alignas(64) uint32_t pw[N][NG][TILE / 2];
    float unit[N][NG];
    for (int r = 0; r < N; ++r) {
      const __mmask16 seen = key_mask(t0, *rows[r]);
      for (int g = 0; g < NG; ++g) {
        __m512 factor;
        if (seen == 0xffff) {  // the tile's own factors (set: some row sees the whole tile)
          factor = t.p_to_int[g];
          unit[r][g] = t.unit[g];
        } else {
          p_factors(_mm512_maskz_mov_ps(seen, t.vscale[g]), &factor, &unit[r][g]);
        }
        _mm256_store_si256((__m256i*)pw[r][g], _mm512_cvtepi32_epi16(_mm512_cvt_roundps_epi32(
            _mm512_mul_ps(s[r], factor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      }
    }
    __m512i pv[N][NACC];
    for (int r = 0; r < N; ++r)
      for (int i = 0; i < NACC; ++i) pv[r][i] = _mm512_setzero_si512();
    for (int jj = 0; jj < TILE / 2; ++jj)
      for (int i = 0; i < NACC; ++i) {
        const __m512i vv = v_pairs<BITS, RAW>(t, jj, i);
        for (int r = 0; r < N; ++r)
          pv[r][i] = _mm512_dpwssd_epi32(pv[r][i], vv, _mm512_set1_epi32((int)pw[r][i / V_GROUP_VECS][jj]));
      }
    for (int r = 0; r < N; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int i = 0; i < NACC; ++i) {
        const __m512 prev = _mm512_mul_ps(_mm512_load_ps(rows[r]->acc + 16 * i), a);
        _mm512_store_ps(rows[r]->acc + 16 * i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(pv[r][i]), _mm512_set1_ps(unit[r][i / V_GROUP_VECS]), prev));
      }
    }
  }
};

// Rows in groups of RB; V is widened into the tile once when more than one group reads it (the same
// values either way: the result does not depend on it).
template <int BITS, bool CAP>
inline void attend_rows(Tile& t, int t0, Row* const* rows, int count, Logits L) {
  using Q = Quant<BITS>;
  if (count <= RB) {
    switch (count) {
      case 4: if constexpr (RB == 4) Q::template attend<4, true, CAP>(t, t0, rows, L); break;
      case 3: if constexpr (RB >= 3) Q::template attend<3, true, CAP>(t, t0, rows, L); break;
      case 2: if constexpr (RB >= 2) Q::template attend<2, true, CAP>(t, t0, rows, L); break;
      case 1: Q::template attend<1, true, CAP>(t, t0, rows, L); break;
      default: break;
    }
    return;
  }
  unpack_v<BITS>(&t);
  for (; count >= RB; count -= RB, rows += RB) Q::template attend<RB, false, CAP>(t, t0, rows, L);
  switch (count) {  // the rest, 1..RB-1 rows
    case 3: if constexpr (RB > 3) Q::template attend<3, false, CAP>(t, t0, rows, L); break;
    case 2: if constexpr (RB > 2) Q::template attend<2, false, CAP>(t, t0, rows, L); break;
    case 1: if constexpr (RB > 1) Q::template attend<1, false, CAP>(t, t0, rows, L); break;
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
      for (int i = 0; i < k_lines; ++i) _mm_prefetch((const char*)(kc + b * code_bytes + ((int64_t)i * bs + o) * 4), _MM_HINT_T1);
      prefetch_l2(vc + b * code_bytes + (int64_t)o * D * BITS / 8, TILE * D * BITS / 8);
      for (int g = 0; g < Q::NG; ++g) {
        _mm_prefetch((const char*)(S.k + b * scale_elems + (int64_t)g * bs + o), _MM_HINT_T1);
        _mm_prefetch((const char*)(S.v + b * scale_elems + (int64_t)g * bs + o), _MM_HINT_T1);
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

// bits 8 or 4; dtype of q and out: 0 = fp32, 1 = bf16; softcap: the logit soft-cap (0 = none). Returns 0, or
// < 0 for arguments it does not take.
int bj_paged_attention_quant(const void* q, int64_t q_token_stride, void* out, const void* k_codes, const void* v_codes,
                             const void* k_scales, const void* v_scales, const int32_t* block_tables, int max_blocks,
                             const int32_t* seq_lens, const int32_t* query_start_loc, int num_rows, int num_heads,
                             int num_kv_heads, int block_size, int window, float scale, float softcap, int bits,
                             int dtype, int num_threads) {
  if (num_heads != num_kv_heads * G || block_size % TILE != 0 || softcap < 0) return -2;
  Args A{q, out, k_codes, v_codes, block_tables, seq_lens, query_start_loc, q_token_stride,
         max_blocks, num_heads, num_kv_heads, block_size, window, Logits::make(scale, softcap)};
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
#ifdef __AVX512BF16__
  } else if (bits == 8 && dtype == 1) {
    go(I8{}, H{});
  } else if (bits == 4 && dtype == 1) {
    go(I4{}, H{});
#endif
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
