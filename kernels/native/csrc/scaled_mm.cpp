// The W8A8 int8 weight matmul on the CPU (vec.h: AVX-512, AVX2 or generic):
// - bj_int8_linear: the whole call in one (quantize the rows, the integer GEMM on a weight packed at load by
//   bj_pack_int8_weight, the rescale from registers), on every path; the GEMM's micro-kernel is the path's own
//   (below);
// - bj_quantize_rows_int8: x [rows, k] (fp32 or bf16) -> int8 codes and one fp32 scale per row (symmetric,
//   dynamic): one pass over the row for its absmax, one to scale, round half to even and clamp;
// - bj_rescale_rows: a GEMM's accumulators [rows, n] (int32, or fp32 holding the int32 sums exactly
//   converted) -> ((float)acc * x_scale[row]) * w_scale[col] (+ bias[col]) rounded to the output dtype.
// The last two are the ends alone, around another GEMM (measured: docs/design/int8-matmul.md).
//
// Must equal, bitwise: kernels/reference/scaled_mm.py quantize_rows_int8 and int8_scaled_mm (the same fp32
// operations in the same order: -ffp-contract=off keeps the products and sums apart; the int32 sums are exact
// on every path, so their order does not matter). Tested by tests/kernels/test_linear_int8.py on each path this
// CPU runs. A row depends on itself alone (its scale, its outputs): results do not depend on the batch, the row's
// position or the thread count.

#include "vec.h"

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

// ---- the two ends, on every path --------------------------------------------------------------------------------

// a row's quantization step: its scale (amax / 127, 1 for an all-zero row) and the factor its values are multiplied
// by; the reference's `127 / amax` is torch's scalar / tensor: a reciprocal, then times 127 (not one division)
template <typename T>
inline float row_factor(const T* xr, int k, float* scale) {
  vf amax = vzero();
  for (int i = 0; i < k; i += 16) amax = vmax(amax, vabs(vload(xr + i, tail(k, i))));
  const float a = reduce_max(amax);  // max is exact in any order
  *scale = a > 0.0f ? a / 127.0f : 1.0f;
  return a > 0.0f ? (1.0f / a) * 127.0f : 1.0f;
}

// the codes of 16 values (lanes outside m: 0), as fp32 integers in [-127, 127]: round half to even, clamp
template <typename T>
inline vf codes16(const T* x, m16 m, vf inv) {
  return vmin(vmax(round_even(vload(x, m) * inv), vset(-127.0f)), vset(127.0f));
}

template <typename T>
void quantize_rows(const T* x, int64_t stride, int rows, int k, int8_t* q, float* scale, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if ((int64_t)rows * k >= 65536)
  for (int r = 0; r < rows; ++r) {
    const T* xr = x + r * stride;
    const vf inv = vset(row_factor(xr, k, scale + r));
    int8_t* qr = q + (int64_t)r * k;
    for (int i = 0; i < k; i += 16) {
      const m16 m = tail(k, i);
      store_bytes(qr + i, to_int_trunc(codes16(xr + i, m, inv)), m);
    }
  }
}

inline vf acc_load(const float* p, m16 m) { return vload(p, m); }
inline vf acc_load(const int32_t* p, m16 m) { return to_float(vload_i(p, m)); }  // nearest even, as .float()

// 16 outputs of a row from its exact int32 sums: ((float)acc * xs) * ws (+ bias) rounded to T, or the sums
template <typename T>
inline void finish16(vi acc, float xs, const float* ws, const float* bias, T* out, m16 m) {
  if constexpr (std::is_same_v<T, int32_t>) {
    vstore_i(out, acc, m);
  } else {
    vf v = (to_float(acc) * vset(xs)) * vload(ws, m);
    if (bias) v = v + vload(bias, m);
    vstore(out, v, m);
  }
}

template <typename A, typename T>
void rescale_rows(const A* acc, int rows, int n, const float* xs, const float* ws, const float* bias, T* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if ((int64_t)rows * n >= 65536)
  for (int r = 0; r < rows; ++r) {
    const A* ar = acc + (int64_t)r * n;
    T* o = out + (int64_t)r * n;
    const vf s = vset(xs[r]);
    for (int i = 0; i < n; i += 16) {
      const m16 m = tail(n, i);
      vf v = (acc_load(ar + i, m) * s) * vload(ws + i, m);
      if (bias) v = v + vload(bias + i, m);
      vstore(o + i, v, m);
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
// The whole W8A8 call in one (bj_int8_linear): quantize the rows into a scratch buffer (in the form the path's
// micro-kernel reads), the GEMM, the rescale from registers. On a Zen 4 (AVX512-VNNI) oneDNN's int8 inner product
// took 0.4-0.5 s for one 64-row matmul, and three ops cost 25-30 us a call more than one (docs/design/int8-matmul.md).
//
// The weight is packed once (bj_pack_int8_weight), the same on every path, in blocks of 64 output columns: block b
// holds, for each quad of k (k/4 of them, k padded to a multiple of 4 with zeros), 64 columns x 4 bytes, so one
// k-quad of a block is 256 contiguous bytes (four zmm or eight ymm of 16 / 8 columns x 4 bytes) and a block
// streams in order. `corr` [column] = 128 * sum_k w[col, k] (used by the VNNI kernels).
//
// The micro-kernels (one per path; each gives the exact int32 sums, so all give the same results):
// - AVX512-VNNI (`vpdpbusd`, AMD Zen 4, Intel Ice Lake and later) and AVX-VNNI (`vpdpbusd` on ymm, Intel Alder
//   Lake and later, Zen 5): unsigned bytes times signed bytes, four products summed into each int32 lane. The
//   activation codes q (signed, [-127, 127]) go in as q + 128 (unsigned), and the sum gains 128 * sum_k w[n, k]:
//   `corr`, subtracted in the epilogue (|sum| < 255 * 127 * k < 2**31 for k < 66,000).
// - AVX2 without VNNI (AMD Zen 2/3, Intel Haswell to Comet Lake): `vpmaddubsw` (u8 x s8, adjacent products summed
//   into a *saturating* int16), `vpmaddwd` by ones (int16 pairs into int32), `vpaddd`: llama.cpp's Q8_0 scheme.
//   q + 128 (up to 255) times w (up to 127) can pass 32767 in a pair, so the row is kept instead as |q| (unsigned,
//   <= 127) and its sign mask s (0xff where q < 0), and the weight byte goes in as w ^ s: w where q >= 0, ~w = -w - 1
//   (in [-128, 126]) where q < 0. A pair is then at most 2 * 127 * 128 = 32512 and never saturates, and
//   |q| * ~w = q * w + q, so the int32 sum is the exact one plus sum_{q < 0} q: a per-row constant computed with the
//   codes and subtracted in the epilogue. (llama.cpp's `vpsignb`, w * sign(q) and no correction, measured 5-25%
//   slower on Zen 3: vpsignb competes for the multiply pipes, vpxor runs on any.) Per 32 products: vpxor (the
//   weight a memory operand), vpmaddubsw, vpmaddwd, vpaddd; two of the four on the two vector-multiply pipes:
//   26-29 products a cycle in a loop on Zen 3, against 16 fp32 FMA lanes (1.7-1.8x).
// - AVX-512 without VNNI (Skylake-SP): the AVX2 kernel.
// - generic: plain int32 loops over the same packing (what the compiler makes of them; ~20 GOP/s on 2 Zen 3 cores).
// Threads take contiguous runs of columns (`UNIT`s); the rows' tiles go past a unit one after the other (it stays
// in L1/L2).

namespace {

constexpr int NB = 64;  // output columns per packed block

inline int round_up(int v, int m) { return (v + m - 1) / m * m; }

inline int32_t load4(const uint8_t* p) {
  int32_t w;
  memcpy(&w, p, 4);
  return w;
}

#if defined(BJ_ISA_AVX512) && defined(__AVX512VNNI__)
#define BJ_GEMM_ZMM_VNNI 1
#elif defined(BJ_ISA_AVX512) || defined(BJ_ISA_AVX2)
#if defined(__AVXVNNI__)
#define BJ_GEMM_YMM_VNNI 1
#else
#define BJ_GEMM_YMM_SIGN 1
#endif
#else
#define BJ_GEMM_GENERIC 1
#endif

#if defined(BJ_GEMM_ZMM_VNNI) || defined(BJ_GEMM_YMM_VNNI)
// the row as unsigned codes u = q + 128 [kp] (padding 128: it meets zero weights)
inline int64_t row_bytes(int kp) { return kp; }

template <typename T>
inline void prepare_row(const T* xr, int k, int kp, uint8_t* u, float* scale) {
  const vf inv = vset(row_factor(xr, k, scale));
  for (int i = 0; i < kp; i += 16)
    store_bytes(u + i, to_int_trunc(codes16(xr + i, tail(k, i), inv)) + iset(128), tail(kp, i));
}
inline void prepare_row(const int8_t* xr, int k, int kp, uint8_t* u, float*) {
  for (int i = 0; i < kp; ++i) u[i] = (uint8_t)((i < k ? xr[i] : 0) + 128);
}
#elif defined(BJ_GEMM_YMM_SIGN)
// the row as |q| [kp], then its sign bytes (0xff where q < 0) [kp] (both 0 in the padding), then the int32
// correction sum_{q < 0} q (the xor trick adds it: see micro_tile)
inline int64_t row_bytes(int kp) { return 2 * (int64_t)kp + 4; }

// 16 int32 codes (8 + 8) at i: their |q| and sign bytes (the row's last quad may be cut short by kp)
inline void store_abs_sign(uint8_t* a, int kp, int i, __m256i lo, __m256i hi) {
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8);                  // 16 x int16, in order
  const __m128i q = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));  // 16 x int8
  const __m128i mag = _mm_abs_epi8(q), sgn = _mm_cmpgt_epi8(_mm_setzero_si128(), q);
  if (kp - i >= 16) {
    _mm_storeu_si128((__m128i*)(a + i), mag);
    _mm_storeu_si128((__m128i*)(a + kp + i), sgn);
  } else {
    alignas(16) uint8_t t[32];
    _mm_store_si128((__m128i*)t, mag);
    _mm_store_si128((__m128i*)(t + 16), sgn);
    memcpy(a + i, t, kp - i);
    memcpy(a + kp + i, t + 16, kp - i);
  }
}
template <typename T>
inline void prepare_row(const T* xr, int k, int kp, uint8_t* a, float* scale) {
  const vf inv = vset(row_factor(xr, k, scale));
  __m256i neg = _mm256_setzero_si256();
  for (int i = 0; i < kp; i += 16) {
    const vi c = to_int_trunc(codes16(xr + i, tail(k, i), inv));
#if defined(BJ_ISA_AVX512)
    const __m256i lo = _mm512_castsi512_si256(c.v), hi = _mm512_extracti64x4_epi64(c.v, 1);
#else
    const __m256i lo = c.a, hi = c.b;
#endif
    store_abs_sign(a, kp, i, lo, hi);
    neg = _mm256_add_epi32(neg, _mm256_add_epi32(_mm256_min_epi32(lo, _mm256_setzero_si256()),
                                                  _mm256_min_epi32(hi, _mm256_setzero_si256())));
  }
  alignas(32) int32_t t[8];
  _mm256_store_si256((__m256i*)t, neg);
  const int32_t corr = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
  memcpy(a + 2 * kp, &corr, 4);
}
inline void prepare_row(const int8_t* xr, int k, int kp, uint8_t* a, float*) {
  int32_t corr = 0;
  for (int i = 0; i < kp; ++i) {
    const int8_t q = i < k ? xr[i] : 0;
    a[i] = (uint8_t)(q < 0 ? -q : q);
    a[kp + i] = q < 0 ? 0xff : 0;
    corr += q < 0 ? q : 0;
  }
  memcpy(a + 2 * kp, &corr, 4);
}
#else
// the row as its int8 codes q [kp] (0 in the padding)
inline int64_t row_bytes(int kp) { return kp; }

template <typename T>
inline void prepare_row(const T* xr, int k, int kp, uint8_t* a, float* scale) {
  const vf inv = vset(row_factor(xr, k, scale));
  for (int i = 0; i < kp; i += 16) store_bytes(a + i, to_int_trunc(codes16(xr + i, tail(k, i), inv)), tail(kp, i));
}
inline void prepare_row(const int8_t* xr, int k, int kp, uint8_t* a, float*) {
  for (int i = 0; i < kp; ++i) a[i] = (uint8_t)(i < k ? xr[i] : 0);
}
#endif

// Everything a block's tiles need but their rows
template <typename T>
struct Block {
  const int8_t* w;     // the packed block
  const int32_t* corr; // its 64 columns' corrections
  const float* ws;     // its columns' weight scales (null for the sums)
  const float* bias;   // or null
  T* out;              // row 0's first output of the block
  int64_t ldo;
  int cols;            // real columns in the block (<= 64)
};

#if defined(BJ_GEMM_ZMM_VNNI)
// ---- AVX512-VNNI: MR rows x 64 columns a micro-tile (4 x MR accumulators + 4 weight registers + 1 of 32 zmm) ----
constexpr int MR_MAX = 6;

template <int MR, typename T>
inline void micro_tile(const uint8_t* a, int64_t lda, int kp, const Block<T>& B, const float* xs, const char* pf,
                       int pf_lines, int r0) {
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
    const int8_t* b = B.w + (int64_t)q * NB * 4;
    for (due += pf_lines; due >= kq; due -= kq) _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);
    const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 64), b2 = _mm512_loadu_si512(b + 128),
                  b3 = _mm512_loadu_si512(b + 192);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512i av = _mm512_set1_epi32(load4(a + r * lda + q * 4));
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], av, b0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], av, b1);
      acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], av, b2);
      acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], av, b3);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const int c = j * 16;
    if (c >= B.cols) break;
    const m16 m = tail(B.cols, c);
    const vi cr = vload_i(B.corr + c);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      finish16(vi{acc[r][j]} - cr, xs[r], B.ws ? B.ws + c : nullptr, B.bias ? B.bias + c : nullptr,
               B.out + (r0 + r) * B.ldo + c, m);
  }
}

template <typename T>
inline void rows_tile(int mr, const uint8_t* a, int64_t lda, int kp, const Block<T>& B, const float* xs, const char* pf,
                      int pf_lines, int r0) {
  switch (mr) {
    case 6: micro_tile<6>(a, lda, kp, B, xs, pf, pf_lines, r0); break;
    case 5: micro_tile<5>(a, lda, kp, B, xs, pf, pf_lines, r0); break;
    case 4: micro_tile<4>(a, lda, kp, B, xs, pf, pf_lines, r0); break;
    case 3: micro_tile<3>(a, lda, kp, B, xs, pf, pf_lines, r0); break;
    case 2: micro_tile<2>(a, lda, kp, B, xs, pf, pf_lines, r0); break;
    default: micro_tile<1>(a, lda, kp, B, xs, pf, pf_lines, r0); break;
  }
}

constexpr int UNIT = NB;  // columns a thread takes at a time: whole blocks

// rows [r0, r1) of the block; the next block (`nxt`, or null) prefetched in equal parts over the row tiles
template <typename T>
inline void block_rows(const uint8_t* a, int64_t lda, int kp, const Block<T>& B, const float* xs, int r0, int r1,
                       int, int, const char* nxt) {
  const int tiles = (r1 - r0 + MR_MAX - 1) / MR_MAX, lines = kp * NB / 64, share = (lines + tiles - 1) / tiles;
  for (int r = r0, t = 0; r < r1; r += MR_MAX, ++t)
    rows_tile(std::min(MR_MAX, r1 - r), a + r * lda, lda, kp, B, xs + r, nxt ? nxt + (int64_t)t * share * 64 : nullptr,
              nxt ? std::max(0, std::min(share, lines - t * share)) : 0, r);
}

#elif defined(BJ_GEMM_YMM_VNNI) || defined(BJ_GEMM_YMM_SIGN)
// ---- ymm (AVX2, with AVX-VNNI where the compiler targets it): MR rows x 8 * NV columns a micro-tile, NV ymm of 8
// columns x 4 bytes a quad. The main tile is 3 rows x 32 columns: 12 accumulators + the row's one or two
// broadcasts + ones + a temporary = 16 ymm, the weights read as memory operands. Measured on Zen 3 (one core, hot
// in L1, GMAC/s): 3x32 and 2x32 82, 1x64 80, 3x16 77, 4x16 67, 6x16 61 (that one spills): with NV = 2 the two
// broadcasts per row and quad cost more load slots than the tile saves; 82 is ~0.88 products-of-32 a cycle, the
// loop's ceiling (vpmaddubsw and vpmaddwd share the two vector-multiply pipes). A single row (a decode step) takes
// a 1 x 32 tile. Threads split the columns in units of 32 (half blocks): 576 and 960 columns split evenly. ----
constexpr int MR_MAX = 3, NV_MAIN = 4;

inline vi join(__m256i lo, __m256i hi) {
#if defined(BJ_ISA_AVX512)
  return {_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)};
#else
  return {lo, hi};
#endif
}

#if defined(BJ_GEMM_YMM_SIGN)
// acc += t, as a GCC vector operation: with _mm256_add_epi32 (or an asm add) GCC 12 spills accumulators of the
// smaller tiles to the stack and copies others back and forth; with this it keeps every one in its register
typedef int v8si __attribute__((vector_size(32)));
inline void add_to(__m256i& acc, __m256i t) { acc = (__m256i)((v8si)acc + (v8si)t); }
#endif

// rows r0.. (MR of them) x the 8 * NV columns at c of the block
template <int MR, int NV, typename T>
inline void micro_tile(const uint8_t* a, int64_t lda, int kp, const Block<T>& B, const float* xs, int r0, int c) {
  __m256i acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm256_setzero_si256();
  const int kq = kp / 4;
  const int8_t* b = B.w + c * 4;
#if defined(BJ_GEMM_YMM_SIGN)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int q = 0; q < kq; ++q, b += NB * 4) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const uint8_t* ar = a + r * lda + q * 4;
#if defined(BJ_GEMM_YMM_VNNI)
      const __m256i av = _mm256_set1_epi32(load4(ar));
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j)
        acc[r][j] = _mm256_dpbusd_avx_epi32(acc[r][j], av, _mm256_loadu_si256((const __m256i*)(b + 32 * j)));
#else
      // |q| and q's sign mask, 4 bytes each, in every dword; the weight's bytes flipped where q < 0 (see the top)
      const __m256i mag = _mm256_set1_epi32(load4(ar)), sgn = _mm256_set1_epi32(load4(ar + kp));
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) {
        const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(b + 32 * j)), sgn);
        add_to(acc[r][j], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, w), ones));
      }
#endif
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NV; j += 2) {
    const int cj = c + 8 * j;
    if (cj >= B.cols) break;
    const m16 m = tail(B.cols, cj);
    const float* ws = B.ws ? B.ws + cj : nullptr;
    const float* bias = B.bias ? B.bias + cj : nullptr;
#if defined(BJ_GEMM_YMM_VNNI)
    const vi cr = vload_i(B.corr + cj);
#endif
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#if defined(BJ_GEMM_YMM_VNNI)
      const vi cr_r = cr;
#else
      int32_t neg;  // sum_{q < 0} q of the row, which the flipped bytes added
      memcpy(&neg, a + r * lda + 2 * kp, 4);
      const vi cr_r = iset(neg);
#endif
      finish16(join(acc[r][j], acc[r][j + 1]) - cr_r, xs[r], ws, bias, B.out + (r0 + r) * B.ldo + cj, m);
    }
  }
}

template <int NV, typename T>
inline void rows_tile(int mr, const uint8_t* a, int64_t lda, int kp, const Block<T>& B, const float* xs, int r0,
                      int c) {
  static_assert(MR_MAX == 3, "rows_tile dispatches 1 to 3 rows");
  switch (mr) {
    case 3: micro_tile<3, NV>(a, lda, kp, B, xs, r0, c); break;
    case 2: micro_tile<2, NV>(a, lda, kp, B, xs, r0, c); break;
    default: micro_tile<1, NV>(a, lda, kp, B, xs, r0, c); break;
  }
}

constexpr int UNIT = 32;  // columns a thread takes at a time

// rows [r0, r1) x the columns [c0, c0 + width) of the block
template <typename T>
inline void block_rows(const uint8_t* a, int64_t lda, int kp, const Block<T>& B, const float* xs, int r0, int r1,
                       int c0, int width, const char*) {
  for (int c = c0; c < c0 + width; c += 8 * NV_MAIN)
    for (int r = r0; r < r1; r += MR_MAX)
      rows_tile<NV_MAIN>(std::min(MR_MAX, r1 - r), a + r * lda, lda, kp, B, xs + r, r, c);
}

#else
// ---- generic: MR rows x 64 columns of int32 sums in plain loops ----
constexpr int MR_MAX = 4;

constexpr int UNIT = NB;

template <typename T>
inline void block_rows(const uint8_t* a, int64_t lda, int kp, const Block<T>& B, const float* xs, int r0, int r1,
                       int, int, const char*) {
  const int kq = kp / 4;
  for (int r = r0; r < r1; r += MR_MAX) {
    const int mr = std::min(MR_MAX, r1 - r);
    int32_t acc[MR_MAX][NB] = {};
    for (int q = 0; q < kq; ++q) {
      const int8_t* b = B.w + (int64_t)q * NB * 4;
      for (int i = 0; i < mr; ++i) {
        const int8_t* ar = (const int8_t*)a + (r + i) * lda + q * 4;
        const int32_t a0 = ar[0], a1 = ar[1], a2 = ar[2], a3 = ar[3];
        for (int j = 0; j < NB; ++j)
          acc[i][j] += a0 * b[4 * j] + a1 * b[4 * j + 1] + a2 * b[4 * j + 2] + a3 * b[4 * j + 3];
      }
    }
    for (int i = 0; i < mr; ++i)
      for (int c = 0; c < B.cols; c += 16)
        finish16(vload_i(acc[i] + c), xs[r + i], B.ws ? B.ws + c : nullptr, B.bias ? B.bias + c : nullptr,
                 B.out + (r + i) * B.ldo + c, tail(B.cols, c));
  }
}
#endif

constexpr int PANEL = 192;  // rows whose prepared codes stay in L2 while a thread's units go past them

template <typename X, typename T>
void int8_linear(const X* x, int64_t stride, const float* x_scale, int m, int k, const int8_t* packed,
                 const int32_t* corr, int n, const float* ws, const float* bias, T* out, int threads) {
  const int kp = round_up(k, 4), nblocks = (n + NB - 1) / NB, units = (n + UNIT - 1) / UNIT;
  const int64_t lda = row_bytes(kp);
  // the rows in the micro-kernel's form and their scales: scratch kept by the calling thread (freed with it), grown
  // as needed
  static thread_local std::vector<uint8_t> codes;
  static thread_local std::vector<float> scales;
  if ((int64_t)codes.size() < m * lda) codes.resize(m * lda);
  if ((int)scales.size() < m) scales.resize(m);
  uint8_t* a = codes.data();
  float* xs = scales.data();
  // one thread when there is too little work to share (a step's many small calls)
  const int nt = (int64_t)m * n * k >= (1 << 18) ? threads : 1;
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (int r = 0; r < m; ++r) {
      xs[r] = x_scale ? x_scale[r] : 1.0f;  // int8 codes come with their scales (float rows: set here)
      prepare_row(x + r * stride, k, kp, a + r * lda, xs + r);
    }
    for (int p = 0; p < m; p += PANEL) {
      const int pe = std::min(m, p + PANEL);
#pragma omp for schedule(static) nowait
      for (int u = 0; u < units; ++u) {
        const int b = u * UNIT / NB, c0 = b * NB, c = u * UNIT - c0;
        const Block<T> B{packed + (int64_t)b * kp * NB, corr + c0, ws ? ws + c0 : nullptr, bias ? bias + c0 : nullptr,
                         out + c0, n, std::min(NB, n - c0)};
        const char* nxt = b + 1 < nblocks ? (const char*)(B.w + (int64_t)kp * NB) : nullptr;
        block_rows(a, lda, kp, B, xs, p, pe, c, std::min(UNIT, B.cols - c), nxt);
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

}  // namespace

// 1: bj_int8_linear runs in this build (every path has it now; kept for the loader's check)
extern "C" int bj_int8_linear_available() { return 1; }

// the micro-kernel this build runs: "avx512-vnni", "avx-vnni", "avx2" or "generic"
extern "C" const char* bj_int8_linear_kernel() {
#if defined(BJ_GEMM_ZMM_VNNI)
  return "avx512-vnni";
#elif defined(BJ_GEMM_YMM_VNNI)
  return "avx-vnni";
#elif defined(BJ_GEMM_YMM_SIGN)
  return "avx2";
#else
  return "generic";
#endif
}

// x [m, k] (row stride `stride`) @ the packed int8 weight -> out [m, n] (contiguous). x: 0 fp32 or 1 bf16 (quantized
// here per row: int8_scaled_mm(quantize_rows_int8(x), ...) bitwise), or 2 int8 codes with their fp32 scales
// `x_scale` [m] (null: 1). out: 0 fp32 or 1 bf16 (rescaled), or 2 int32 (the exact sums; ws and bias unused).
// Returns 0, or 1 for arguments it refuses.
extern "C" int bj_int8_linear(const void* x, int64_t stride, int xdtype, const float* x_scale, int m, int k,
                              const int8_t* packed, const int32_t* corr, int n, const float* ws, const float* bias,
                              void* out, int odtype, int threads) {
  if (m < 0 || k <= 0 || n <= 0 || stride < k || (odtype != 2 && ws == nullptr)) return 1;
  if (m == 0) return 0;
  if (xdtype == 0) return int8_linear_to((const float*)x, stride, x_scale, m, k, packed, corr, n, ws, bias, out, odtype, threads);
  if (xdtype == 1) return int8_linear_to((const uint16_t*)x, stride, x_scale, m, k, packed, corr, n, ws, bias, out, odtype, threads);
  if (xdtype == 2) return int8_linear_to((const int8_t*)x, stride, x_scale, m, k, packed, corr, n, ws, bias, out, odtype, threads);
  return 1;
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
