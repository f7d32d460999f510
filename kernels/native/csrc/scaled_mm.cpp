// The two ends of a W8A8 int8 weight matmul on the CPU (AVX-512), around oneDNN's int8 GEMM (AMX or VNNI):
// - bj_quantize_rows_int8: x [rows, k] (fp32 or bf16) -> int8 codes and one fp32 scale per row (symmetric,
//   dynamic): one pass over the row for its absmax, one to scale, round half to even and clamp;
// - bj_rescale_rows: the GEMM's accumulators [rows, n] (int32, or fp32 holding the int32 sums exactly
//   converted) -> ((float)acc * x_scale[row]) * w_scale[col] (+ bias[col]) rounded to the output dtype.
// Each replaces 4-6 torch ops and their temporaries (measured: docs/design/int8-matmul.md).
//
// Must equal, bitwise: kernels/reference/scaled_mm.py quantize_rows_int8 and the rescale of int8_scaled_mm
// (the same fp32 operations in the same order: -ffp-contract=off keeps the products and sums apart).
// Tested by tests/kernels/test_linear_int8.py. A row depends on itself alone (its scale, its outputs):
// results do not depend on the batch, the row's position or the thread count.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

inline __mmask16 tail(int n, int i) { return n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u); }

inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load(const uint16_t* p, __mmask16 m) {  // bf16 widens exactly
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline void store(float* p, __m512 x, __mmask16 m) { _mm512_mask_storeu_ps(p, m, x); }
inline void store(uint16_t* p, __m512 x, __mmask16 m) {  // round to nearest even, as torch's .to(bfloat16)
#ifdef __AVX512BF16__
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(x));
#else
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16)));
#endif
}

template <typename T>
void quantize_rows(const T* x, int64_t stride, int rows, int k, int8_t* q, float* scale, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if ((int64_t)rows * k >= 65536)
  for (int r = 0; r < rows; ++r) {
    const T* xr = x + r * stride;
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load(xr + i, tail(k, i))));
    const float a = _mm512_reduce_max_ps(amax);  // max is exact in any order
    // the reference's `127 / amax` is torch's scalar / tensor: reciprocal, then times 127 (not one division)
    const float inv = a > 0.0f ? (1.0f / a) * 127.0f : 1.0f;
    scale[r] = a > 0.0f ? a / 127.0f : 1.0f;
    const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    int8_t* qr = q + (int64_t)r * k;
    for (int i = 0; i < k; i += 16) {
      const __mmask16 m = tail(k, i);
      __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(load(xr + i, m), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
      _mm_mask_storeu_epi8(qr + i, m, _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v)));
    }
  }
}

inline __m512 acc_load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 acc_load(const int32_t* p, __mmask16 m) {  // int32 -> fp32 rounds to nearest even, as .float()
  return _mm512_cvt_roundepi32_ps(_mm512_maskz_loadu_epi32(m, p), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

template <typename A, typename T>
void rescale_rows(const A* acc, int rows, int n, const float* xs, const float* ws, const float* bias, T* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if ((int64_t)rows * n >= 65536)
  for (int r = 0; r < rows; ++r) {
    const A* ar = acc + (int64_t)r * n;
    T* o = out + (int64_t)r * n;
    const __m512 s = _mm512_set1_ps(xs[r]);
    for (int i = 0; i < n; i += 16) {
      const __mmask16 m = tail(n, i);
      __m512 v = _mm512_mul_ps(_mm512_mul_ps(acc_load(ar + i, m), s), load(ws + i, m));
      if (bias) v = _mm512_add_ps(v, load(bias + i, m));
      store(o + i, v, m);
    }
  }
}

}  // namespace

// dtype: 0 fp32, 1 bf16 (kernels/native/ops.py's codes). Returns 0, or 1 for arguments it refuses.
extern "C" int bj_quantize_rows_int8(const void* x, int64_t stride, int rows, int k, int dtype, int8_t* q, float* scale,
                                     int threads) {
  if (rows < 0 || k <= 0 || stride < k) return 1;
  if (dtype == 0) quantize_rows((const float*)x, stride, rows, k, q, scale, threads);
  else if (dtype == 1) quantize_rows((const uint16_t*)x, stride, rows, k, q, scale, threads);
  else return 1;
  return 0;
}

// acc_int32: 1 for int32 accumulators, 0 for fp32 ones; bias fp32 [n] or null.
extern "C" int bj_rescale_rows(const void* acc, int acc_int32, int rows, int n, const float* xs, const float* ws,
                               const float* bias, void* out, int dtype, int threads) {
  if (rows < 0 || n <= 0) return 1;
  if (acc_int32) {
    if (dtype == 0) rescale_rows((const int32_t*)acc, rows, n, xs, ws, bias, (float*)out, threads);
    else if (dtype == 1) rescale_rows((const int32_t*)acc, rows, n, xs, ws, bias, (uint16_t*)out, threads);
    else return 1;
  } else {
    if (dtype == 0) rescale_rows((const float*)acc, rows, n, xs, ws, bias, (float*)out, threads);
    else if (dtype == 1) rescale_rows((const float*)acc, rows, n, xs, ws, bias, (uint16_t*)out, threads);
    else return 1;
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// The whole W8A8 call in one (bj_int8_linear): quantize the rows, the GEMM on AVX512-VNNI `vpdpbusd`, the rescale
// from registers. For CPUs with VNNI (AMD Zen 4, Intel Ice Lake and later): oneDNN's int8 inner product took 0.4-0.5 s
// for one 64-row matmul on Zen 4, and three ops cost 25-30 us a call more than one (docs/design/int8-matmul.md).
//
// vpdpbusd multiplies unsigned bytes by signed bytes: the activation codes q (signed, [-127, 127]) go in as
// q + 128 (unsigned), and the sum gains 128 * sum_k w[n, k], a per-column constant precomputed at packing
// (`corr`) and subtracted: the int32 sums are exact (|sum| < 255 * 127 * k < 2**31 for k < 66,000).
//
// The weight is packed once (bj_pack_int8_weight) in blocks of 64 output columns: block b holds, for each
// quad of k (k/4 of them, k padded to a multiple of 4 with zeros), 64 columns x 4 bytes = four zmm of
// 16 columns each, so one k-quad of a block is 256 contiguous bytes and a block streams in order.
// A micro-tile is MR rows (up to 6) x 64 columns: 4 x MR int32 accumulators over all of k, then
// ((float)(acc - corr) * x_scale[row]) * w_scale[col] (+ bias) rounded to the output dtype, the reference's
// rescale. Integer sums do not depend on the order: a row's result depends on that row alone.
// Threads take contiguous runs of blocks; the rows' tiles go past a block one after the other (it stays in L2),
// and while they do, they prefetch the next block in equal parts (it comes from memory: a step's weights do not
// fit in the caches; measured on Zen 4, same process A/B: 1.1-1.3x on gate/up and the LM head at 1-64 rows,
// neutral on the narrow layers).

namespace {

constexpr int NB = 64;  // output columns per packed block

inline int round_up(int v, int m) { return (v + m - 1) / m * m; }

#ifdef __AVX512VNNI__
constexpr int MR_MAX = 6;  // rows per micro-tile: 4 x 6 accumulators + 4 weight registers + 1 of 32 zmm

// one row x [k] -> unsigned codes u = q + 128 [kp] (padding 128: it meets zero weights) and its scale
template <typename T>
inline void quantize_row_u8(const T* xr, int k, int kp, uint8_t* u, float* scale) {
  __m512 amax = _mm512_setzero_ps();
  for (int i = 0; i < k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load(xr + i, tail(k, i))));
  const float a = _mm512_reduce_max_ps(amax);
  const float inv = a > 0.0f ? (1.0f / a) * 127.0f : 1.0f;  // as quantize_rows above
  *scale = a > 0.0f ? a / 127.0f : 1.0f;
  const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  const __m512i shift = _mm512_set1_epi32(128);
  for (int i = 0; i < kp; i += 16) {
    const __mmask16 m = tail(k, i), mp = tail(kp, i);
    __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(load(xr + i, m), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    _mm_mask_storeu_epi8(u + i, mp, _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvttps_epi32(v), shift)));
  }
}

// int8 codes given (with their scales, by the caller): only the shift and the padding
inline void codes_row_u8(const int8_t* xr, int k, int kp, uint8_t* u) {
  const __m512i shift = _mm512_set1_epi8((char)0x80);
  for (int i = 0; i < kp; i += 64) {
    const int left = kp - i, real = k - i;
    const __mmask64 mp = left >= 64 ? ~0ull : ((1ull << left) - 1), m = real >= 64 ? ~0ull : real > 0 ? ((1ull << real) - 1) : 0;
    _mm512_mask_storeu_epi8(u + i, mp, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, xr + i), shift));
  }
}

template <int MR, typename T>
inline void micro_tile(const uint8_t* a, int kp, const int8_t* blk, const char* pf, int pf_lines, const int32_t* corr,
                       const float* xs, const float* ws, const float* bias, T* out, int64_t ldo, int cols) {
  __m512i acc[MR][4];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
  const int kq = kp / 4;
  // pf_lines cache lines at pf (of the next block: towards L2 while this block computes), spread evenly over the
  // k loop (Bresenham: `due` counts pf_lines per quad against kq)
  int due = 0, line = 0;
  for (int q = 0; q < kq; ++q) {
    const int8_t* b = blk + (int64_t)q * NB * 4;
    for (due += pf_lines; due >= kq; due -= kq) _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);
    const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 64), b2 = _mm512_loadu_si512(b + 128),
                  b3 = _mm512_loadu_si512(b + 192);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t word;
      __builtin_memcpy(&word, a + (int64_t)r * kp + q * 4, 4);
      const __m512i av = _mm512_set1_epi32(word);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], av, b0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], av, b1);
      acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], av, b2);
      acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], av, b3);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const int c = j * 16;
    if (c >= cols) break;
    const __mmask16 m = tail(cols, c);
    const __m512i cr = _mm512_loadu_si512(corr + c);
    if constexpr (std::is_same_v<T, int32_t>) {  // the exact sums
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) _mm512_mask_storeu_epi32(out + r * ldo + c, m, _mm512_sub_epi32(acc[r][j], cr));
    } else {
      const __m512 w = load(ws + c, m), bv = bias ? load(bias + c, m) : _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 f = _mm512_cvt_roundepi32_ps(_mm512_sub_epi32(acc[r][j], cr), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(f, _mm512_set1_ps(xs[r])), w);
        if (bias) v = _mm512_add_ps(v, bv);
        store(out + r * ldo + c, v, m);
      }
    }
  }
}

template <typename T>
inline void rows_tile(int mr, const uint8_t* a, int kp, const int8_t* blk, const char* pf, int pf_lines,
                      const int32_t* corr, const float* xs, const float* ws, const float* bias, T* out, int64_t ldo,
                      int cols) {
  switch (mr) {
    case 6: micro_tile<6>(a, kp, blk, pf, pf_lines, corr, xs, ws, bias, out, ldo, cols); break;
    case 5: micro_tile<5>(a, kp, blk, pf, pf_lines, corr, xs, ws, bias, out, ldo, cols); break;
    case 4: micro_tile<4>(a, kp, blk, pf, pf_lines, corr, xs, ws, bias, out, ldo, cols); break;
    case 3: micro_tile<3>(a, kp, blk, pf, pf_lines, corr, xs, ws, bias, out, ldo, cols); break;
    case 2: micro_tile<2>(a, kp, blk, pf, pf_lines, corr, xs, ws, bias, out, ldo, cols); break;
    default: micro_tile<1>(a, kp, blk, pf, pf_lines, corr, xs, ws, bias, out, ldo, cols); break;
  }
}

constexpr int PANEL = 192;  // rows whose codes stay in L2 while a thread's blocks go past them

template <typename X, typename T>
void int8_linear(const X* x, int64_t stride, const float* x_scale, int m, int k, const int8_t* packed,
                 const int32_t* corr, int n, const float* ws, const float* bias, T* out, int threads) {
  const int kp = round_up(k, 4), nblocks = (n + NB - 1) / NB;
  // the codes and scales of the rows: scratch kept by the calling thread (freed with it), grown as needed
  static thread_local std::vector<uint8_t> codes;
  static thread_local std::vector<float> scales;
  if ((int64_t)codes.size() < (int64_t)m * kp) codes.resize((int64_t)m * kp);
  if ((int)scales.size() < m) scales.resize(m);
  uint8_t* a = codes.data();
  float* xs = scales.data();
  // one thread when there is too little work to share (a step's many small calls)
  const int nt = (int64_t)m * n * k >= (1 << 18) ? threads : 1;
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (int r = 0; r < m; ++r) {
      if constexpr (std::is_same_v<X, int8_t>) {
        codes_row_u8(x + r * stride, k, kp, a + (int64_t)r * kp);
        xs[r] = x_scale ? x_scale[r] : 1.0f;
      } else {
        quantize_row_u8(x + r * stride, k, kp, a + (int64_t)r * kp, xs + r);
      }
    }
    for (int p = 0; p < m; p += PANEL) {
      const int pe = std::min(m, p + PANEL);
#pragma omp for schedule(static) nowait
      for (int b = 0; b < nblocks; ++b) {
        const int c0 = b * NB, cols = std::min(NB, n - c0);
        const int8_t* blk = packed + (int64_t)b * kp * NB;
        // the next block (this thread's, with static scheduling) in equal parts over this block's row tiles
        const int tiles = (pe - p + MR_MAX - 1) / MR_MAX, lines = kp * NB / 64, share = (lines + tiles - 1) / tiles;
        const char* nxt = b + 1 < nblocks ? (const char*)(blk + (int64_t)kp * NB) : nullptr;
        for (int r = p, t = 0; r < pe; r += MR_MAX, ++t)
          rows_tile(std::min(MR_MAX, pe - r), a + (int64_t)r * kp, kp, blk, nxt ? nxt + (int64_t)t * share * 64 : nullptr,
                    nxt ? std::max(0, std::min(share, lines - t * share)) : 0, corr + c0, xs + r, ws ? ws + c0 : nullptr,
                    bias ? bias + c0 : nullptr, out + (int64_t)r * n + c0, n, cols);
      }
    }
  }
}

template <typename X>
int int8_linear_to(const X* x, int64_t stride, const float* x_scale, int m, int k, const int8_t* packed,
                   const int32_t* corr, int n, const float* ws, const float* bias, void* out, int odtype, int threads) {
  if (odtype == 0) int8_linear(x, stride, x_scale, m, k, packed, corr, n, ws, bias, (float*)out, threads);
  else if (odtype == 1) int8_linear(x, stride, x_scale, m, k, packed, corr, n, ws, bias, (uint16_t*)out, threads);
  else if (odtype == 2) int8_linear(x, stride, x_scale, m, k, packed, corr, n, ws, bias, (int32_t*)out, threads);
  else return 1;
  return 0;
}

#endif  // __AVX512VNNI__

}  // namespace

extern "C" int bj_int8_linear_available() {
#ifdef __AVX512VNNI__
  return 1;
#else
  return 0;
#endif
}

// x [m, k] (row stride `stride`) @ the packed int8 weight -> out [m, n] (contiguous). x: 0 fp32 or 1 bf16 (quantized
// here per row: int8_scaled_mm(quantize_rows_int8(x), ...) bitwise), or 2 int8 codes with their fp32 scales
// `x_scale` [m] (null: 1). out: 0 fp32 or 1 bf16 (rescaled), or 2 int32 (the exact sums; ws and bias unused).
// Returns 0, 1 for arguments it refuses, 2 where this build has no VNNI (bj_int8_linear_available).
extern "C" int bj_int8_linear(const void* x, int64_t stride, int xdtype, const float* x_scale, int m, int k,
                              const int8_t* packed, const int32_t* corr, int n, const float* ws, const float* bias,
                              void* out, int odtype, int threads) {
#ifndef __AVX512VNNI__
  return 2;
#else
  if (m < 0 || k <= 0 || n <= 0 || stride < k || (odtype != 2 && ws == nullptr)) return 1;
  if (m == 0) return 0;
  if (xdtype == 0) return int8_linear_to((const float*)x, stride, x_scale, m, k, packed, corr, n, ws, bias, out, odtype, threads);
  if (xdtype == 1) return int8_linear_to((const uint16_t*)x, stride, x_scale, m, k, packed, corr, n, ws, bias, out, odtype, threads);
  if (xdtype == 2) return int8_linear_to((const int8_t*)x, stride, x_scale, m, k, packed, corr, n, ws, bias, out, odtype, threads);
  return 1;
#endif
}
// w int8 [n, k] (row-major) -> packed [ceil(n/64)][kp/4][64][4], kp = k rounded up to 4, zeros in the padding;
// corr int32 [ceil(n/64)*64] = 128 * sum_k w[col, k] (0 for padding columns).
extern "C" int bj_pack_int8_weight(const int8_t* w, int n, int k, int8_t* packed, int32_t* corr, int threads) {
  if (n <= 0 || k <= 0) return 1;
  const int kp = round_up(k, 4), blocks = (n + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int b = 0; b < blocks; ++b) {
    int8_t* blk = packed + (int64_t)b * kp * NB;
    for (int j = 0; j < NB; ++j) {
      const int c = b * NB + j;
      int32_t s = 0;
      for (int kk = 0; kk < kp; ++kk) {
        const int8_t v = (c < n && kk < k) ? w[(int64_t)c * k + kk] : 0;
        blk[(kk / 4) * NB * 4 + j * 4 + kk % 4] = v;
        s += v;
      }
      corr[c] = 128 * s;
    }
  }
  return 0;
}
