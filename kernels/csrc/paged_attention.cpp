// Paged attention over block tables on the CPU (AVX-512): decode rows, prefill chunks and extends in one
// kernel, reading K/V where they lie in the paged cache (no gather, no padding).
//
// Must equal: kernels/attention.py (`paged_attention_torch`) within fp32 rounding.
// Tested by:  tests/test_native_kernels.py (head_dim 64/80/96/128, GQA 1-8, blocks 16/32, fp32 and bf16
//             caches, sliding window, chunked prefill, prefix hits; bitwise batch invariance).
//
// Batch invariance (a row's output is bitwise the same alone or in any batch, with any thread count, in
// any prefill chunking, decoded or recomputed): every (query token, query head) pair is computed by the
// same instruction sequence, whatever else is in the step. Keys are visited in tiles of 16 aligned to
// absolute positions; each tile's dot products, max, exp, sum and P.V run in a fixed order per query
// row; one work item (row, KV head, query tile) is done start to end by one thread; no split depends on
// the batch or the thread count.
//
// Layouts: q [tokens, heads, D] (token stride given), out [tokens, heads, D] contiguous; query head i
// reads KV head i / G (HF's repeat_kv). The caches are laid out for this kernel (kernels/native.py
// allocates them, bj_store_kv writes them), so that a tile of 16 keys is a run of plain 64-byte loads:
//   bf16 K [blocks, kv_heads, D/2, block_size] dwords, each the pair of dims (2i, 2i+1) of one key
//        V [blocks, kv_heads, block_size/2, D] dwords, each dim d of the keys (2j, 2j+1)
//   fp32 K [blocks, kv_heads, D, block_size];  V [blocks, kv_heads, block_size, D]
// Compiled per model with -DHEAD_DIM=D -DGQA=G (kernels/native.py).

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <vector>

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<head_dim>"
#endif
#ifndef GQA
#error "compile with -DGQA=<query heads per KV head>"
#endif

namespace {

constexpr int D = HEAD_DIM;
constexpr int G = GQA;
constexpr int TILE = 16;                              // keys per tile (one zmm of fp32 scores)
constexpr int MAX_ROWS = 64;                          // query rows (tokens x heads of a KV head) per work item
constexpr int QTILE = MAX_ROWS / G > 0 ? MAX_ROWS / G : 1;  // query tokens per work item
constexpr int NACC = D / 16;                          // fp32 accumulator vectors per query row
constexpr int RB = 16 / NACC >= 4 ? 4 : (16 / NACC >= 1 ? 16 / NACC : 1);  // query rows computed together
static_assert(D % 16 == 0 && D <= 256, "head_dim must be a multiple of 16, at most 256");
static_assert(G >= 1 && G <= 16, "GQA group must be 1..16");

// exp2 for x <= 0, to ~1 ulp: 2^round(x) * e^(f ln2), f in [-0.5, 0.5], Taylor to degree 7.
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));  // lanes below are masked to 0 by the callers
  const __m512 xi = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, xi);
  __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, xi);
}

// Sum of 16 lanes in a fixed tree (the order is part of the result).
inline float hsum(__m512 v) {
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}


struct Args {
  const void* q;
  void* out;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int64_t q_token_stride;  // elements between consecutive tokens of q
  int max_blocks, num_heads, num_kv_heads, block_size, window;
  float scale_log2;  // softmax scale * log2(e): scores are taken in base 2
};

// One query row: its query vector, its keys [lo, hi) (causal end, sliding-window start), its running
// softmax max m and sum l, and its D fp32 accumulators.
struct Row {
  const void* q;
  float* acc;
  float m, l;
  int lo, hi;
};

inline __mmask16 key_mask(int t0, const Row& r) {
  if (r.lo <= t0 && r.hi >= t0 + TILE) return 0xffff;  // off the diagonal: every key is visible
  const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(t0), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  return _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(r.lo)) & _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(r.hi));
}

// Online-softmax update of n rows (n <= RB) from their raw scores: p (masked lanes 0) and the factor
// each row's accumulators must be scaled by. Every step is lane-wise or per row: a row's numbers do not
// depend on the rows beside it.
template <int N>
inline void softmax_rows(__m512* s, Row* const* rows, int t0, float scale_log2, float* alpha) {
  alignas(64) float diff[16] = {0};
  bool first[N];
  for (int r = 0; r < N; ++r) {
    const __mmask16 valid = key_mask(t0, *rows[r]);
    const __m512 x = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), _mm512_mul_ps(s[r], _mm512_set1_ps(scale_log2)));
    const float m_new = fmaxf(rows[r]->m, _mm512_reduce_max_ps(x));
    s[r] = _mm512_maskz_mov_ps(valid, exp2_ps(_mm512_sub_ps(x, _mm512_set1_ps(m_new))));
    first[r] = rows[r]->m == -INFINITY;
    diff[r] = first[r] ? 0.0f : rows[r]->m - m_new;
    rows[r]->m = m_new;
  }
  _mm512_store_ps(diff, exp2_ps(_mm512_load_ps(diff)));
  for (int r = 0; r < N; ++r) {
    alpha[r] = first[r] ? 1.0f : diff[r];  // a first tile finds acc = 0 and l = 0
    rows[r]->l = (first[r] ? 0.0f : rows[r]->l * alpha[r]) + hsum(s[r]);
  }
}

// ---- fp32 caches ----------------------------------------------------------------------------------
struct F32 {
  using T = float;
  static constexpr int k_rows = D;  // 64-byte lines of a K tile
  // k: this tile's keys, dim d at k + d * bs; v: key j at v + j * D; n keys loaded (the rest is masked)
  template <int N>
  static void attend(const float* k, int bs, const float* v, int n, int t0, Row* const* rows, float scale_log2) {
    __m512 s0[N], s1[N];
    const float* q[N];
    for (int r = 0; r < N; ++r) {
      s0[r] = s1[r] = _mm512_setzero_ps();
      q[r] = (const float*)rows[r]->q;
    }
    for (int d = 0; d < D; d += 2) {
      const __m512 k0 = _mm512_loadu_ps(k + d * bs), k1 = _mm512_loadu_ps(k + (d + 1) * bs);
      for (int r = 0; r < N; ++r) {
        s0[r] = _mm512_fmadd_ps(k0, _mm512_set1_ps(q[r][d]), s0[r]);
        s1[r] = _mm512_fmadd_ps(k1, _mm512_set1_ps(q[r][d + 1]), s1[r]);
      }
    }
    for (int r = 0; r < N; ++r) s0[r] = _mm512_add_ps(s0[r], s1[r]);
    float alpha[N];
    softmax_rows<N>(s0, rows, t0, scale_log2, alpha);
    alignas(64) float p[N][TILE];
    __m512 acc[N][NACC];
    for (int r = 0; r < N; ++r) {
      _mm512_store_ps(p[r], s0[r]);
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int i = 0; i < NACC; ++i) acc[r][i] = _mm512_mul_ps(_mm512_load_ps(rows[r]->acc + 16 * i), a);
    }
    for (int j = 0; j < n; ++j)  // masked keys have p = 0: adding 0 * v leaves acc as it is
      for (int i = 0; i < NACC; ++i) {
        const __m512 vj = _mm512_loadu_ps(v + j * D + 16 * i);
        for (int r = 0; r < N; ++r) acc[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][j]), vj, acc[r][i]);
      }
    for (int r = 0; r < N; ++r)
      for (int i = 0; i < NACC; ++i) _mm512_store_ps(rows[r]->acc + 16 * i, acc[r][i]);
  }

  static void store(const float* acc, float inv_l, float* out) {
    const __m512 s = _mm512_set1_ps(inv_l);
    for (int i = 0; i < NACC; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(_mm512_load_ps(acc + 16 * i), s));
  }
};

#ifdef __AVX512BF16__
// ---- bf16 caches ----------------------------------------------------------------------------------
// Q.K: one dpbf16 per dim pair with the query pair broadcast gives 16 keys' partial scores. P.V: P is
// rounded to bf16 (as torch's CPU flash attention and FlashAttention do) and one dpbf16 per key pair
// adds two keys' products to 16 dims; every sum is fp32.
struct BF16 {
  using T = uint16_t;
  static constexpr int k_rows = D / 2;  // 64-byte lines of a K tile
  // k (dwords): pair i of this tile's keys at k + i * bs; v (dwords): key pair jj at v + jj * D
  template <int N>
  static void attend(const uint32_t* k, int bs, const uint32_t* v, int n, int t0, Row* const* rows, float scale_log2) {
    (void)n;  // keys past n are masked: their p is 0
    __m512 s0[N], s1[N];
    const uint32_t* q[N];
    for (int r = 0; r < N; ++r) {
      s0[r] = s1[r] = _mm512_setzero_ps();
      q[r] = (const uint32_t*)rows[r]->q;
    }
    for (int i = 0; i < D / 2; i += 2) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k + i * bs), k1 = (__m512bh)_mm512_loadu_si512(k + (i + 1) * bs);
      for (int r = 0; r < N; ++r) {
        s0[r] = _mm512_dpbf16_ps(s0[r], k0, (__m512bh)_mm512_set1_epi32((int)q[r][i]));
        s1[r] = _mm512_dpbf16_ps(s1[r], k1, (__m512bh)_mm512_set1_epi32((int)q[r][i + 1]));
      }
    }
    for (int r = 0; r < N; ++r) s0[r] = _mm512_add_ps(s0[r], s1[r]);
    float alpha[N];
    softmax_rows<N>(s0, rows, t0, scale_log2, alpha);
    alignas(32) uint32_t p[N][TILE / 2];
    __m512 acc[N][NACC];
    for (int r = 0; r < N; ++r) {
      _mm256_store_si256((__m256i*)p[r], (__m256i)_mm512_cvtneps_pbh(s0[r]));
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int i = 0; i < NACC; ++i) acc[r][i] = _mm512_mul_ps(_mm512_load_ps(rows[r]->acc + 16 * i), a);
    }
    for (int jj = 0; jj < TILE / 2; ++jj)
      for (int i = 0; i < NACC; ++i) {
        const __m512bh vp = (__m512bh)_mm512_loadu_si512(v + jj * D + 16 * i);
        for (int r = 0; r < N; ++r) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], vp, (__m512bh)_mm512_set1_epi32((int)p[r][jj]));
      }
    for (int r = 0; r < N; ++r)
      for (int i = 0; i < NACC; ++i) _mm512_store_ps(rows[r]->acc + 16 * i, acc[r][i]);
  }

  static void store(const float* acc, float inv_l, uint16_t* out) {
    const __m512 s = _mm512_set1_ps(inv_l);
    for (int i = 0; i < NACC; ++i)
      _mm256_storeu_si256((__m256i*)(out + 16 * i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc + 16 * i), s)));
  }
};
#endif

template <typename K>
inline void attend_rows(const void* k, int bs, const void* v, int n, int t0, Row* const* rows, int count, float sl) {
  using W = typename std::conditional<std::is_same<typename K::T, float>::value, float, uint32_t>::type;
  const W* kw = (const W*)k;
  const W* vw = (const W*)v;
  for (; count >= RB; count -= RB, rows += RB) K::template attend<RB>(kw, bs, vw, n, t0, rows, sl);
  switch (count) {  // the rest, 1..RB-1 rows
    case 3: if constexpr (RB > 3) K::template attend<3>(kw, bs, vw, n, t0, rows, sl); break;
    case 2: if constexpr (RB > 2) K::template attend<2>(kw, bs, vw, n, t0, rows, sl); break;
    case 1: if constexpr (RB > 1) K::template attend<1>(kw, bs, vw, n, t0, rows, sl); break;
    default: break;
  }
}

inline void prefetch_l2(const void* p, int bytes) {
  for (int b = 0; b < bytes; b += 64) _mm_prefetch((const char*)p + b, _MM_HINT_T1);
}

// One work item: query tokens [tb, te) of row `row` (positions p0 + (t - qs)), KV head h.
template <typename K>
void run_item(const Args& A, int row, int h, int tb, int te) {
  using T = typename K::T;
  const int bs = A.block_size;
  const int qs = A.query_start_loc[row];
  const int p0 = A.seq_lens[row] - (A.query_start_loc[row + 1] - qs);
  const int nrows = (te - tb) * G;
  const int32_t* table = A.block_tables + (int64_t)row * A.max_blocks;
  const int64_t head_elems = (int64_t)bs * D;  // K or V elements of one (block, KV head)
  const T* kc = (const T*)A.k_cache;
  const T* vc = (const T*)A.v_cache;

  alignas(64) float acc[MAX_ROWS][D];
  Row rows[MAX_ROWS];
  int klo = 1 << 30, khi = 0;
  for (int r = 0; r < nrows; ++r) {
    const int t = tb + r / G, head = h * G + r % G, pos = p0 + (t - qs);
    Row& w = rows[r];
    w.q = (const T*)A.q + t * A.q_token_stride + (int64_t)head * D;
    w.acc = acc[r];
    w.m = -INFINITY;
    w.l = 0.0f;
    w.hi = pos + 1;
    w.lo = A.window > 0 && pos + 1 > A.window ? pos + 1 - A.window : 0;
    klo = w.lo < klo ? w.lo : klo;
    khi = w.hi > khi ? w.hi : khi;
    memset(acc[r], 0, sizeof(float) * D);
  }
  // K and V of this KV head in the block holding key t0, and the tile's offset inside it
  auto k_block = [&](int t0) { return kc + ((int64_t)table[t0 / bs] * A.num_kv_heads + h) * head_elems; };
  auto v_block = [&](int t0) { return vc + ((int64_t)table[t0 / bs] * A.num_kv_heads + h) * head_elems; };
  constexpr int k_unit = std::is_same<T, float>::value ? 1 : 2;  // bf16 K is addressed in dwords of 2
  Row* active[MAX_ROWS];
  for (int t0 = klo / TILE * TILE; t0 < khi; t0 += TILE) {
    // The next tile into L2 while this one is computed: its block may be anywhere in the pool. Measured on
    // 30 DRAM-resident layers, 64 rows, contexts 100-380 (2 cores): 0.59 ms per layer vs 0.85 without
    // prefetch, 0.76 prefetching the next whole block into L1, 1.05 the next tile into L1.
    if (t0 + TILE < khi) {
      const int tn = t0 + TILE, o = tn % bs;
      const T* k_next = k_block(tn) + o * k_unit;
      for (int i = 0; i < K::k_rows; ++i) _mm_prefetch((const char*)(k_next + (int64_t)i * bs * k_unit), _MM_HINT_T1);
      prefetch_l2(v_block(tn) + (int64_t)o * D, TILE * D * (int)sizeof(T));
    }
    int count = 0;
    for (int r = 0; r < nrows; ++r)
      if (rows[r].hi > t0 && rows[r].lo < t0 + TILE) active[count++] = &rows[r];  // rows that see a key here
    const int n = khi - t0 < TILE ? khi - t0 : TILE;
    const int off = t0 % bs;
    attend_rows<K>(k_block(t0) + off * k_unit, bs, v_block(t0) + (int64_t)off * D, n, t0, active, count, A.scale_log2);
  }
  T* out = (T*)A.out;
  for (int r = 0; r < nrows; ++r) {
    const int t = tb + r / G, head = h * G + r % G;
    K::store(acc[r], 1.0f / rows[r].l, out + ((int64_t)t * A.num_heads + head) * D);
  }
}

template <typename K>
void run(const Args& A, int num_rows, int num_threads) {
  // work items (row, first token), longest queries first so that big prefill items do not finish last
  std::vector<int> item_row, item_tok;
  for (int row = num_rows - 1; row >= 0; --row)
    for (int t = A.query_start_loc[row]; t < A.query_start_loc[row + 1]; t += QTILE) {
      item_row.push_back(row);
      item_tok.push_back(t);
    }
  const int n_items = (int)item_row.size() * A.num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int it = 0; it < n_items; ++it) {
    const int i = it / A.num_kv_heads, h = it % A.num_kv_heads;
    const int row = item_row[i], tb = item_tok[i];
    const int qe = A.query_start_loc[row + 1];
    run_item<K>(A, row, h, tb, tb + QTILE < qe ? tb + QTILE : qe);
  }
}

// Write each new token's K and V into its cache slot, in the layouts above.
template <typename T>
void store_kv(const T* k, const T* v, int64_t k_stride, int64_t v_stride, T* kc, T* vc, const int64_t* slots,
              int tokens, int num_kv_heads, int bs, int num_threads) {
  const int64_t head_elems = (int64_t)bs * D;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * num_kv_heads >= 64)
  for (int t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // a padding token
    const int64_t block = slot / bs;
    const int off = (int)(slot % bs);
    for (int h = 0; h < num_kv_heads; ++h) {
      const T* ks = k + t * k_stride + (int64_t)h * D;
      const T* vs = v + t * v_stride + (int64_t)h * D;
      T* kb = kc + (block * num_kv_heads + h) * head_elems;
      T* vb = vc + (block * num_kv_heads + h) * head_elems;
      if (std::is_same<T, float>::value) {
        for (int d = 0; d < D; ++d) kb[(int64_t)d * bs + off] = ks[d];
        memcpy(vb + (int64_t)off * D, vs, sizeof(T) * D);
      } else {
        uint32_t* kd = (uint32_t*)kb;
        const uint32_t* kp = (const uint32_t*)ks;
        for (int i = 0; i < D / 2; ++i) kd[(int64_t)i * bs + off] = kp[i];
        T* vrow = vb + (int64_t)(off / 2) * D * 2 + (off & 1);
        for (int d = 0; d < D; ++d) vrow[2 * d] = vs[d];
      }
    }
  }
}

}  // namespace

extern "C" {

int bj_head_dim() { return D; }
int bj_gqa() { return G; }
int bj_has_bf16() {
#ifdef __AVX512BF16__
  return 1;
#else
  return 0;
#endif
}

// dtype: 0 = fp32, 1 = bf16 (q, caches and out all of it). Returns 0, or -1 for an unsupported dtype.
int bj_paged_attention(const void* q, int64_t q_token_stride, void* out, const void* k_cache, const void* v_cache,
                       const int32_t* block_tables, int max_blocks, const int32_t* seq_lens,
                       const int32_t* query_start_loc, int num_rows, int num_heads, int num_kv_heads,
                       int block_size, int window, float scale, int dtype, int num_threads) {
  if (num_heads != num_kv_heads * G || block_size % TILE != 0) return -2;
  Args A{q, out, k_cache, v_cache, block_tables, seq_lens, query_start_loc, q_token_stride,
         max_blocks, num_heads, num_kv_heads, block_size, window, scale * 1.4426950408889634f};
  if (dtype == 0) {
    run<F32>(A, num_rows, num_threads);
    return 0;
  }
#ifdef __AVX512BF16__
  if (dtype == 1) {
    run<BF16>(A, num_rows, num_threads);
    return 0;
  }
#endif
  return -1;
}

// dtype as above; k, v [tokens, kv_heads, D] with the given token strides; slots < 0 are skipped.
int bj_store_kv(const void* k, int64_t k_stride, const void* v, int64_t v_stride, void* k_cache, void* v_cache,
                const int64_t* slots, int tokens, int num_kv_heads, int block_size, int dtype, int num_threads) {
  if (block_size % 2) return -2;
  if (dtype == 0) {
    store_kv<float>((const float*)k, (const float*)v, k_stride, v_stride, (float*)k_cache, (float*)v_cache, slots,
                    tokens, num_kv_heads, block_size, num_threads);
    return 0;
  }
  if (dtype == 1) {
    store_kv<uint16_t>((const uint16_t*)k, (const uint16_t*)v, k_stride, v_stride, (uint16_t*)k_cache,
                       (uint16_t*)v_cache, slots, tokens, num_kv_heads, block_size, num_threads);
    return 0;
  }
  return -1;
}

}  // extern "C"
