// Paged attention over block tables on the CPU (vec.h: AVX-512, AVX2 or generic): decode rows, prefill chunks and extends in one
// kernel, reading K/V where they lie in the paged cache (no gather, no padding).
//
// Must equal: kernels/reference/attention.py (`paged_attention_torch`, with its `window` and `softcap`) within fp32
//             rounding.
// Tested by:  tests/kernels/test_native_kernels.py (head_dim 64/80/96/128, GQA 1-8, blocks 16/32, fp32 and bf16
//             caches, sliding window, chunked prefill, prefix hits; bitwise batch invariance; the logit soft-cap
//             at head_dim 64 and 256, decodes and prefill, with and without a window).
//
// Logit soft-cap (Gemma 2, `softcap` > 0): each score becomes tanh(s * scale / cap) * cap before the online
// softmax's max and exp (Logits in attention_common.h; tanh_ps in simd_math.h, lane-wise). It is a template
// parameter of the work item, chosen once per call: without a cap the kernel runs the same instructions
// as before the cap existed (compared in the disassembly; the same speed measured).
//
// Batch invariance (a row's output is bitwise the same alone or in any batch, with any thread count, in
// any prefill chunking, decoded or recomputed): every (query token, query head) pair is computed by the
// same instruction sequence, whatever else is in the step. Keys are visited in tiles of 16 aligned to
// absolute positions; each tile's dot products, max, exp, sum and P.V run in a fixed order per query
// row; one work item (row, KV head, query tile) is done start to end by one thread; no split depends on
// the batch or the thread count.
//
// Layouts: q [tokens, heads, D] (token stride given), out [tokens, heads, D] contiguous; query head i
// reads KV head i / G (HF's repeat_kv). The caches are laid out for this kernel (kernels/native/ops.py
// allocates them, bj_store_kv writes them), so that a tile of 16 keys is a run of plain 64-byte loads:
//   bf16 K [blocks, kv_heads, D/2, block_size] dwords, each the pair of dims (2i, 2i+1) of one key
//        V [blocks, kv_heads, block_size/2, D] dwords, each dim d of the keys (2j, 2j+1)
//   fp32 K [blocks, kv_heads, D, block_size];  V [blocks, kv_heads, block_size, D]
// Compiled per model with -DHEAD_DIM=D -DGQA=G (kernels/native/ops.py).

#include "attention_common.h"

namespace {

// ---- fp32 caches ----------------------------------------------------------------------------------
struct F32 {
  using T = float;
  static constexpr int k_rows = D;  // 64-byte lines of a K tile
  // k: this tile's keys, dim d at k + d * bs; v: key j at v + j * D; n keys loaded (the rest is masked)
  template <int N, bool CAP>
  static void attend(const float* k, int bs, const float* v, int n, int t0, Row* const* rows, Logits L) {
    vf s0[N], s1[N];
    const float* q[N];
    for (int r = 0; r < N; ++r) {
      s0[r] = s1[r] = vzero();
      q[r] = (const float*)rows[r]->q;
    }
    for (int d = 0; d < D; d += 2) {
      const vf k0 = vload(k + d * bs), k1 = vload(k + (d + 1) * bs);
      for (int r = 0; r < N; ++r) {
        s0[r] = fmadd(k0, vset(q[r][d]), s0[r]);
        s1[r] = fmadd(k1, vset(q[r][d + 1]), s1[r]);
      }
    }
    for (int r = 0; r < N; ++r) s0[r] = s0[r] + s1[r];
    float alpha[N];
    softmax_rows<N, CAP>(s0, rows, t0, L, alpha);
    alignas(64) float p[N][TILE];
    vf acc[N][NACC];
    for (int r = 0; r < N; ++r) {
      vstore(p[r], s0[r]);
      const vf a = vset(alpha[r]);
      for (int i = 0; i < NACC; ++i) acc[r][i] = vload(rows[r]->acc + 16 * i) * a;
    }
    for (int j = 0; j < n; ++j)  // masked keys have p = 0: adding 0 * v leaves acc as it is
      for (int i = 0; i < NACC; ++i) {
        const vf vj = vload(v + j * D + 16 * i);
        for (int r = 0; r < N; ++r) acc[r][i] = fmadd(vset(p[r][j]), vj, acc[r][i]);
      }
    for (int r = 0; r < N; ++r)
      for (int i = 0; i < NACC; ++i) vstore(rows[r]->acc + 16 * i, acc[r][i]);
  }
};

// ---- bf16 caches ----------------------------------------------------------------------------------
// Q.K: one bf16-pair dot product (vec.h dot_bf16_pairs: `vdpbf16ps` with AVX512-BF16, two FMAs on the widened
// halves elsewhere) per dim pair with the query pair broadcast gives 16 keys' partial scores. P.V: P is rounded
// to bf16 (as torch's CPU flash attention and FlashAttention do) and one pair product per key pair adds two keys'
// products to 16 dims; every sum is fp32.
struct BF16 {
  using T = uint16_t;
  static constexpr int k_rows = D / 2;  // 64-byte lines of a K tile
  // k (dwords): pair i of this tile's keys at k + i * bs; v (dwords): key pair jj at v + jj * D
  template <int N, bool CAP>
  static void attend(const uint32_t* k, int bs, const uint32_t* v, int n, int t0, Row* const* rows, Logits L) {
    (void)n;  // keys past n are masked: their p is 0
    vf s0[N], s1[N];
    const uint32_t* q[N];
    for (int r = 0; r < N; ++r) {
      s0[r] = s1[r] = vzero();
      q[r] = (const uint32_t*)rows[r]->q;
    }
    for (int i = 0; i < D / 2; i += 2) {
      const uint32_t* k0 = k + i * bs;
      const uint32_t* k1 = k + (i + 1) * bs;
      for (int r = 0; r < N; ++r) {
        s0[r] = dot_bf16_pairs(s0[r], k0, q[r][i]);
        s1[r] = dot_bf16_pairs(s1[r], k1, q[r][i + 1]);
      }
    }
    for (int r = 0; r < N; ++r) s0[r] = s0[r] + s1[r];
    float alpha[N];
    softmax_rows<N, CAP>(s0, rows, t0, L, alpha);
    alignas(64) uint16_t ph[N][TILE];  // P in bf16; read back as key pairs (dwords) below
    alignas(64) uint32_t p[N][TILE / 2];
    vf acc[N][NACC];
    for (int r = 0; r < N; ++r) {
      vstore_bf16(ph[r], s0[r]);
      memcpy(p[r], ph[r], sizeof ph[r]);
      const vf a = vset(alpha[r]);
      for (int i = 0; i < NACC; ++i) acc[r][i] = vload(rows[r]->acc + 16 * i) * a;
    }
    for (int jj = 0; jj < TILE / 2; ++jj)
      for (int i = 0; i < NACC; ++i) {
        const uint32_t* vp = v + jj * D + 16 * i;
        for (int r = 0; r < N; ++r) acc[r][i] = dot_bf16_pairs(acc[r][i], vp, p[r][jj]);
      }
    for (int r = 0; r < N; ++r)
      for (int i = 0; i < NACC; ++i) vstore(rows[r]->acc + 16 * i, acc[r][i]);
  }
};

template <typename K, bool CAP>
inline void attend_rows(const void* k, int bs, const void* v, int n, int t0, Row* const* rows, int count, Logits L) {
  using W = typename std::conditional<std::is_same<typename K::T, float>::value, float, uint32_t>::type;
  const W* kw = (const W*)k;
  const W* vw = (const W*)v;
  for (; count >= RB; count -= RB, rows += RB) K::template attend<RB, CAP>(kw, bs, vw, n, t0, rows, L);
  switch (count) {  // the rest, 1..RB-1 rows
    case 3: if constexpr (RB > 3) K::template attend<3, CAP>(kw, bs, vw, n, t0, rows, L); break;
    case 2: if constexpr (RB > 2) K::template attend<2, CAP>(kw, bs, vw, n, t0, rows, L); break;
    case 1: if constexpr (RB > 1) K::template attend<1, CAP>(kw, bs, vw, n, t0, rows, L); break;
    default: break;
  }
}

// One work item: query tokens [tb, te) of row `row` (positions p0 + (t - qs)), KV head h.
template <typename K, bool CAP>
void run_item(const Args& A, int row, int h, int tb, int te) {
  using T = typename K::T;
  const int bs = A.block_size;
  const int32_t* table = A.block_tables + (int64_t)row * A.max_blocks;
  const int64_t head_elems = (int64_t)bs * D;  // K or V elements of one (block, KV head)
  const T* kc = (const T*)A.k_cache;
  const T* vc = (const T*)A.v_cache;

  alignas(64) float acc[MAX_ROWS][D];
  Row rows[MAX_ROWS];
  int klo, khi;
  const int nrows = init_rows(A, row, h, tb, te, rows, acc, &klo, &khi, [&](int, int t, int head) {
    return (const void*)((const T*)A.q + t * A.q_token_stride + (int64_t)head * D);
  });
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
      for (int i = 0; i < K::k_rows; ++i) prefetch_l2(k_next + (int64_t)i * bs * k_unit);
      prefetch_l2(v_block(tn) + (int64_t)o * D, TILE * D * (int)sizeof(T));
    }
    int count = 0;
    for (int r = 0; r < nrows; ++r)
      if (rows[r].hi > t0 && rows[r].lo < t0 + TILE) active[count++] = &rows[r];  // rows that see a key here
    const int n = khi - t0 < TILE ? khi - t0 : TILE;
    const int off = t0 % bs;
    attend_rows<K, CAP>(k_block(t0) + off * k_unit, bs, v_block(t0) + (int64_t)off * D, n, t0, active, count, A.logits);
  }
  T* out = (T*)A.out;
  for (int r = 0; r < nrows; ++r) {
    const int t = tb + r / G, head = h * G + r % G;
    store_row(acc[r], 1.0f / rows[r].l, out + ((int64_t)t * A.num_heads + head) * D);
  }
}

template <typename K>
void run(const Args& A, int num_rows, int num_threads) {
  if (A.logits.capped())
    for_each_item(A, num_rows, num_threads, [&](int row, int h, int tb, int te) { run_item<K, true>(A, row, h, tb, te); });
  else
    for_each_item(A, num_rows, num_threads, [&](int row, int h, int tb, int te) { run_item<K, false>(A, row, h, tb, te); });
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
int bj_has_bf16() {  // bf16 dot products in hardware (AVX512-BF16); elsewhere they are emulated in fp32
#ifdef __AVX512BF16__
  return 1;
#else
  return 0;
#endif
}

// dtype: 0 = fp32, 1 = bf16 (q, caches and out all of it); softcap: the logit soft-cap (0 = none); key_ends: per
// query token, the end of its keys where past itself (Args), or nullptr. Returns 0,
// or -1 for an unsupported dtype.
int bj_paged_attention(const void* q, int64_t q_token_stride, void* out, const void* k_cache, const void* v_cache,
                       const int32_t* block_tables, int max_blocks, const int32_t* seq_lens,
                       const int32_t* query_start_loc, int num_rows, int num_heads, int num_kv_heads,
                       int block_size, int window, float scale, float softcap, int dtype, int num_threads,
                       const int32_t* key_ends) {
  if (num_heads != num_kv_heads * G || block_size % TILE != 0 || softcap < 0) return -2;
  Args A{q, out, k_cache, v_cache, block_tables, seq_lens, query_start_loc, q_token_stride,
         max_blocks, num_heads, num_kv_heads, block_size, window, Logits::make(scale, softcap), key_ends};
  if (dtype == 0) {
    run<F32>(A, num_rows, num_threads);
    return 0;
  }
  if (dtype == 1) {
    run<BF16>(A, num_rows, num_threads);
    return 0;
  }
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
