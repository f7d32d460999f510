// Shared by the paged-attention kernels (paged_attention.cpp: fp32/bf16 caches; paged_attention_quant.cpp:
// int8/int4 caches): the compile-time shape, the work-item row, the key mask of a tile, the fixed-order
// online softmax (with Gemma 2's logit soft-cap) and exp2. Everything here is per row and lane-wise, the root of
// batch invariance.
// Written over vec.h (AVX-512, AVX2 or generic, chosen at build); kernels/native/build.py hashes this header into
// every kernel's cache key.
#pragma once

#include "simd_math.h"

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
// query rows computed together: as many as the accumulators fit in registers (32 zmm; 16 ymm, two a vector; the
// generic path takes AVX-512's). A row's arithmetic does not depend on it.
#if defined(BJ_ISA_AVX2)
constexpr int RB = 8 / NACC >= 2 ? 2 : 1;
#else
constexpr int RB = 16 / NACC >= 4 ? 4 : (16 / NACC >= 1 ? 16 / NACC : 1);
#endif
static_assert(D % 16 == 0 && D <= 256, "head_dim must be a multiple of 16, at most 256");
static_assert(G >= 1 && G <= 16, "GQA group must be 1..16");

// How a raw dot product s becomes a base-2 logit: s * scale * log2(e), or with the soft-cap (Gemma 2)
// tanh(s * scale / cap) * cap * log2(e). Kernels take the capped form as a template parameter chosen once
// per call, so the plain one costs what it did before the cap existed.
struct Logits {
  float scale_log2;  // softmax scale * log2(e)
  float cap_in, cap_out;  // scale / cap and cap * log2(e); cap_in = 0: no cap
  static Logits make(float scale, float cap) {
    const float log2e = 1.4426950408889634f;
    return cap > 0.0f ? Logits{scale * log2e, scale / cap, cap * log2e} : Logits{scale * log2e, 0.0f, 0.0f};
  }
  bool capped() const { return cap_in != 0.0f; }
};

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
  Logits logits;
  // per query token, the key position (exclusive) it sees up to where that is past itself (an image's tokens see
  // the whole image both ways: Gemma 3); nullptr or a value <= position + 1: causal
  const int32_t* key_ends;
};

// One query row: its query vector, its keys [lo, hi) (causal end or key_ends', sliding-window start), its running
// softmax max m and sum l, and its D fp32 accumulators.
struct Row {
  const void* q;
  float* acc;
  float m, l;
  int lo, hi;
};

// The query rows of work item (row, KV head h, query tokens [tb, te)): row r is token tb + r / G, query
// head h * G + r % G, its keys [lo, hi) (causal end, window start), its accumulators zeroed; q(r, token,
// head) gives its query pointer. Returns the item's rows, and [klo, khi): the keys any of them sees.
template <typename Q>
inline int init_rows(const Args& A, int row, int h, int tb, int te, Row* rows, float (*acc)[D], int* klo, int* khi, Q q) {
  const int qs = A.query_start_loc[row];
  const int p0 = A.seq_lens[row] - (A.query_start_loc[row + 1] - qs);
  const int nrows = (te - tb) * G;
  *klo = 1 << 30;
  *khi = 0;
  for (int r = 0; r < nrows; ++r) {
    const int t = tb + r / G, head = h * G + r % G, pos = p0 + (t - qs);
    Row& w = rows[r];
    w.q = q(r, t, head);
    w.acc = acc[r];
    w.m = -INFINITY;
    w.l = 0.0f;
    w.hi = A.key_ends != nullptr && A.key_ends[t] > pos + 1 ? A.key_ends[t] : pos + 1;
    w.lo = A.window > 0 && pos + 1 > A.window ? pos + 1 - A.window : 0;
    *klo = w.lo < *klo ? w.lo : *klo;
    *khi = w.hi > *khi ? w.hi : *khi;
    memset(acc[r], 0, sizeof(float) * D);
  }
  return nrows;
}

// The keys [t0, t0 + 16) that row r sees, as a lane mask.
inline m16 key_mask(int t0, const Row& r) {
  if (r.lo <= t0 && r.hi >= t0 + TILE) return ALL;  // off the diagonal: every key is visible
  const int b = r.lo - t0 > 0 ? r.lo - t0 : 0, e = r.hi - t0 < TILE ? r.hi - t0 : TILE;
  return e > b ? (ALL >> (TILE - e)) & ~((1u << b) - 1u) : 0;
}

// Online-softmax update of n rows (n <= RB) from their raw scores: p (masked lanes 0) and the factor
// each row's accumulators must be scaled by. Every step is lane-wise or per row: a row's numbers do not
// depend on the rows beside it. CAP: the scores are soft-capped first (Logits).
template <int N, bool CAP>
inline void softmax_rows(vf* s, Row* const* rows, int t0, Logits L, float* alpha) {
  alignas(64) float diff[16] = {0};
  bool first[N];
  for (int r = 0; r < N; ++r) {
    const m16 valid = key_mask(t0, *rows[r]);
    vf logit;
    if constexpr (CAP)
      logit = tanh_ps(s[r] * vset(L.cap_in)) * vset(L.cap_out);
    else
      logit = s[r] * vset(L.scale_log2);
    const vf x = select(valid, vset(-INFINITY), logit);
    const float m_new = fmaxf(rows[r]->m, reduce_max(x));
    s[r] = keep(valid, exp2_ps(x - vset(m_new)));
    first[r] = rows[r]->m == -INFINITY;
    diff[r] = first[r] ? 0.0f : rows[r]->m - m_new;
    rows[r]->m = m_new;
  }
  vstore(diff, exp2_ps(vload(diff)));
  for (int r = 0; r < N; ++r) {
    alpha[r] = first[r] ? 1.0f : diff[r];  // a first tile finds acc = 0 and l = 0
    rows[r]->l = (first[r] ? 0.0f : rows[r]->l * alpha[r]) + hsum(s[r]);
  }
}

// A row's output: its D accumulators / l, as fp32 or rounded to bf16 (nearest even).
template <typename T>
inline void store_row(const float* acc, float inv_l, T* out) {
  const vf s = vset(inv_l);
  for (int i = 0; i < NACC; ++i) vstore(out + 16 * i, vload(acc + 16 * i) * s);
}

// Runs item(row, KV head, first token, end token) over a step's work items (a row's query tokens in
// runs of QTILE, times its KV heads), longest queries first so that big prefill items do not finish
// last. Which thread runs an item changes nothing in its result.
template <typename F>
void for_each_item(const Args& A, int num_rows, int num_threads, F item) {
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
    item(row, h, tb, tb + QTILE < qe ? tb + QTILE : qe);
  }
}

}  // namespace
