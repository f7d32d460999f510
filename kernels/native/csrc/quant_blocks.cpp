// Weight matmuls on block-quantized weights, computed as stored (kernels/linear_quant.py BlockQuantLinear): the
// GGUF formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K and group-wise int4 (an HF folder quantized at load,
// compressed-tensors W4A16), on every path of vec.h (AVX-512 with VNNI, AVX2, generic C++).
//
// What is stored (bj_qpack_gguf / bj_qpack_codes, once at load), per block of 64 output columns, for every 32 values
// of k (a "chunk": 8 quads of 4 k):
//   - the codes u (unsigned: 0..15, 31, 63 or 255) of 64 columns x 32 k: 4- and 5-bit ones as their low nibbles in 4
//     quad pairs of 256 bytes (byte c * 4 + j of pair p: quad 2p's code (column c, k = 8p + j) in the low nibble, quad
//     2p + 1's in the high), then for 5 bits a bit plane (per quad, four 64-bit words, bit i of word v for byte 64v + i
//     of the quad); 6- and 8-bit codes as their bytes, quad by quad (256 bytes a quad: the GEMM's tile as it is);
//   - the scales as the file has them: fp16 d (and m) per group (Q4_0 ... Q8_0), fp16 D and Dmin per 256 with 6-bit
//     sub-scales and mins per 32 (Q4_K, Q5_K), fp16 D per 256 with int8 sub-scales per 16 (Q6_K), fp32 d (and m) per
//     group (int4). So the weights take the file's bytes in memory, give or take its bit packing.
// A weight is w = d_g * u + m_g per group g: symmetric formats have m_g = -offset * d_g (Q4_0: offset 8, Q5_0: 16,
// Q6_K: 32, Q8_0: 128 on u = q + 128, int4: 8), the others a stored min (Q4_1, Q5_1: m; Q4_K, Q5_K: -Dmin * mn).
//
// A call (bj_qlinear): x [m, k] (fp32 or bf16) -> out [m, n] (fp32 or bf16, + bias):
//   1. each row quantized in blocks of 32 (llama.cpp's Q8_0 for activations): xs = amax / 127, q = x * (127 / amax)
//      rounded half to even; with it the block's sum of codes (sums per 16 where the weight's groups are 16);
//   2. per block of 64 columns (threads take whole blocks): its codes expanded into an int8 tile (k / 4 quads x 64
//      columns x 4 bytes, the int8 GEMM's layout; 8-bit codes are that tile already) and its scales into fp32 d and
//      m per group, once for all rows of the call;
//   3. per tile of rows: the exact int32 sums of each group (AVX512-VNNI `vpdpbusd` on u x q; AVX2 `vpmaddubsw` of
//      u and q summed in int16, then `vpmaddwd`, or for 8-bit codes the |q| and sign trick of scaled_mm.cpp; generic:
//      plain int32 loops), then per group, in fp32: symmetric: t = (float)(isum - offset * qsum) * xs;
//      acc = fma(t, d, acc); with mins: t = (float)isum * xs; acc = fma(t, d, acc); acc = fma(m, xs * (float)qsum, acc);
//      then + bias, rounded to the output dtype.
// The int32 sums are exact on every path and the fp32 steps are the same operations in the same order (fused
// multiply-adds everywhere, -ffp-contract=off around them), so every path gives bitwise the same result, and a row's
// result depends on that row alone: not on the batch, its position, the thread count or the path
// (tests/kernels/test_linear_quant.py). Its accuracy against the dequantized weights: the activations' int8 blocks.
//
// bj_qdequant_cols gives columns (rows of the [n, k] weight: an embedding lookup, or all of them for tests) as
// gguf's own dequantize computes them, bitwise (the same fp32 products and sums in the same order).

#include "vec_int.h"

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int NB = 64;      // output columns per packed block
constexpr int CHUNK = 32;   // k values a code chunk (and an activation block) holds
constexpr int QUADS = CHUNK / 4;

// scale storage kinds (kernels/native/quant_blocks.py ScaleKind)
enum ScaleKind { F16 = 0, KQ = 1, K6 = 2, F32 = 3 };

struct Format {
  int bits;     // 4, 5, 6 or 8
  int group;    // weights per scale along k: 16, 32, or a multiple of 32 (F32 kind)
  int offset;   // symmetric: u's offset (w = d * (u - offset)); -1: a stored min per group
  int kind;     // ScaleKind
  bool sym() const { return offset >= 0; }
  int epi() const { return group < CHUNK ? group : CHUNK; }  // k values per fp32 step: a group, at most a chunk
  // activation values per int8 block: 256 for the K-quants (llama.cpp's Q8_K: the block scale then applies once per
  // 256, after the steps' sums), 32 for the others (llama.cpp's Q8_0)
  bool super() const { return kind == KQ || kind == K6; }
  int ablk() const { return super() ? 256 : CHUNK; }
  // codes of 6 bits and more are kept as bytes (the GEMM's tile itself: no expansion a call; Q6_K then takes 8.6 bits
  // a weight instead of its file's 6.6), 4 and 5 bits as nibbles (and a bit plane)
  bool byte_codes() const { return bits >= 6; }
  int64_t chunk_code_bytes() const { return byte_codes() ? 2048 : 1024 + 256 * (bits - 4); }
  // scale bytes of one column block for all of k
  int64_t scale_bytes(int k) const {
    switch (kind) {
      case F16: return (int64_t)(k / group) * NB * 2 * (sym() ? 1 : 2);
      case F32: return (int64_t)(k / group) * NB * 4 * (sym() ? 1 : 2);
      case KQ: return (int64_t)(k / 256) * (NB * 4 + 8 * NB * 2);
      default: return (int64_t)(k / 256) * (NB * 2 + 16 * NB);  // K6
    }
  }
};

inline bool valid(const Format& f, int k) {
  if (!(f.bits == 4 || f.bits == 5 || f.bits == 6 || f.bits == 8) || k <= 0 || k % CHUNK) return false;
  if (f.kind == KQ) return f.group == 32 && !f.sym() && k % 256 == 0;
  if (f.kind == K6) return f.group == 16 && f.sym() && k % 256 == 0;
  if (f.kind == F16) return f.group == 32;
  if (f.kind == F32) return f.group >= 32 && f.group % 32 == 0 && k % f.group == 0;
  return false;
}

inline uint16_t ld16(const uint8_t* p) { uint16_t v; memcpy(&v, p, 2); return v; }

// ---- scales: one column block's d and m per fp32 step (epi() k values) for steps [e0, e1), as gguf's dequantize
// computes them: d[(e - e0) * 64 + c], m likewise (formats with mins only). F32 groups over 32 repeat per step.
#if defined(BJ_ISA_AVX512)
inline vf load_u8(const uint8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)))}; }
inline vf load_s8(const uint8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)))}; }
#elif defined(BJ_ISA_AVX2)
inline __m256 cvt8(__m128i b, bool sgn) { return _mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b)); }
inline vf load_u8(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  return {cvt8(b, false), cvt8(_mm_srli_si128(b, 8), false)};
}
inline vf load_s8(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  return {cvt8(b, true), cvt8(_mm_srli_si128(b, 8), true)};
}
#else
inline vf load_u8(const uint8_t* p) { vf r; for (int i = 0; i < 16; ++i) r.x[i] = (float)p[i]; return r; }
inline vf load_s8(const uint8_t* p) { vf r; for (int i = 0; i < 16; ++i) r.x[i] = (float)(int8_t)p[i]; return r; }
#endif
inline vf neg(vf a) { return vzero() - a; }  // exact: -(a), the sign flipped (0 - a: +0 for a = +0, as -(+0) is not needed)

void expand_scales(const Format& f, const uint8_t* s, int e0, int e1, float* d, float* m) {
  const int epi = f.epi();
  for (int e = e0; e < e1; ++e) {
    float* de = d + (e - e0) * NB;
    float* me = m ? m + (e - e0) * NB : nullptr;
    const int k0 = e * epi;
    if (f.kind == F16 || f.kind == F32) {
      const int64_t gbytes = (int64_t)NB * (f.kind == F16 ? 2 : 4) * (f.sym() ? 1 : 2);
      const uint8_t* g = s + (k0 / f.group) * gbytes;
      for (int c = 0; c < NB; c += 16) {
        if (f.kind == F16) {
          vstore(de + c, vload_fp16((const uint16_t*)g + c));
          if (me) vstore(me + c, vload_fp16((const uint16_t*)(g + NB * 2) + c));
        } else {
          vstore(de + c, vload((const float*)g + c));
          if (me) vstore(me + c, vload((const float*)(g + NB * 4) + c));
        }
      }
    } else if (f.kind == KQ) {  // per 256: D[64], Dmin[64] (fp16), then 8 x (sc[64], mn[64]) (u8)
      const uint8_t* b = s + (int64_t)(k0 / 256) * (NB * 4 + 8 * NB * 2);
      const int j = (k0 % 256) / 32;
      for (int c = 0; c < NB; c += 16) {
        vstore(de + c, vload_fp16((const uint16_t*)b + c) * load_u8(b + NB * 4 + j * NB * 2 + c));
        vstore(me + c, neg(vload_fp16((const uint16_t*)(b + NB * 2) + c) * load_u8(b + NB * 4 + j * NB * 2 + NB + c)));
      }
    } else {  // K6, per 256: D[64] (fp16), then 16 x sc[64] (int8)
      const uint8_t* b = s + (int64_t)(k0 / 256) * (NB * 2 + 16 * NB);
      const int j = (k0 % 256) / 16;
      for (int c = 0; c < NB; c += 16) vstore(de + c, vload_fp16((const uint16_t*)b + c) * load_s8(b + NB * 2 + j * NB + c));
    }
  }
}

// ---- codes: one chunk's 8 quads x 256 bytes from its packed nibbles and bit planes ------------------------------
#if defined(BJ_ISA_AVX512)
inline void expand_chunk(const uint8_t* src, int bits, uint8_t* tile) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint64_t* planes = (const uint64_t*)(src + 1024);  // [plane][quad][4 words]
  for (int p = 0; p < 4; ++p)
    for (int v = 0; v < 4; ++v) {
      const __m512i x = _mm512_loadu_si512(src + p * 256 + v * 64);
      __m512i lo = _mm512_and_si512(x, low), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
      for (int e = 0; e < bits - 4; ++e) {
        const __m512i bit = _mm512_set1_epi8((char)(0x10 << e));
        lo = _mm512_mask_or_epi32(lo, 0xffff, lo, _mm512_maskz_mov_epi8(planes[(e * 8 + 2 * p) * 4 + v], bit));
        hi = _mm512_mask_or_epi32(hi, 0xffff, hi, _mm512_maskz_mov_epi8(planes[(e * 8 + 2 * p + 1) * 4 + v], bit));
      }
      _mm512_storeu_si512(tile + (2 * p) * 256 + v * 64, lo);
      _mm512_storeu_si512(tile + (2 * p + 1) * 256 + v * 64, hi);
    }
}
#elif defined(BJ_ISA_AVX2)
// 32 bytes: 0x10 << e where bit i of m is set
inline __m256i plane_bytes(uint32_t m, int e) {
  const __m256i rep = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m),
                                          _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                           2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(rep, sel), sel), _mm256_set1_epi8((char)(0x10 << e)));
}
inline void expand_chunk(const uint8_t* src, int bits, uint8_t* tile) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const uint32_t* planes = (const uint32_t*)(src + 1024);  // [plane][quad][8 half-words]
  for (int p = 0; p < 4; ++p)
    for (int v = 0; v < 8; ++v) {
      const __m256i x = _mm256_loadu_si256((const __m256i*)(src + p * 256 + v * 32));
      __m256i lo = _mm256_and_si256(x, low), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
      for (int e = 0; e < bits - 4; ++e) {
        lo = _mm256_or_si256(lo, plane_bytes(planes[(e * 8 + 2 * p) * 8 + v], e));
        hi = _mm256_or_si256(hi, plane_bytes(planes[(e * 8 + 2 * p + 1) * 8 + v], e));
      }
      _mm256_storeu_si256((__m256i*)(tile + (2 * p) * 256 + v * 32), lo);
      _mm256_storeu_si256((__m256i*)(tile + (2 * p + 1) * 256 + v * 32), hi);
    }
}
#else
inline void expand_chunk(const uint8_t* src, int bits, uint8_t* tile) {
  for (int p = 0; p < 4; ++p)
    for (int i = 0; i < 256; ++i) {
      uint8_t lo = src[p * 256 + i] & 0x0F, hi = src[p * 256 + i] >> 4;
      for (int e = 0; e < bits - 4; ++e) {
        const uint8_t* plane = src + 1024 + e * 256;
        lo |= (uint8_t)(((plane[(2 * p) * 32 + i / 8] >> (i % 8)) & 1) << (4 + e));
        hi |= (uint8_t)(((plane[(2 * p + 1) * 32 + i / 8] >> (i % 8)) & 1) << (4 + e));
      }
      tile[(2 * p) * 256 + i] = lo;
      tile[(2 * p + 1) * 256 + i] = hi;
    }
}
#endif

// ---- the rows: int8 codes per block of 32, their scales and what each fp32 step subtracts or adds --------------
struct Rows {
  int k, steps, nblk;        // nblk: activation blocks a row
  int64_t q_stride;          // bytes per row in q (k, or 2k + pad for the AVX2 8-bit form)
  uint8_t* q;                // [m][q_stride]
  float* xs;                 // [m][k / 32]
  int32_t* ci;               // [m][steps] symmetric: what the step's sum loses (offset * qsum, or the sign trick's)
  float* cf;                 // [m][steps] with mins: xs * qsum of the step's k
};

#if defined(BJ_ISA_AVX2) || (defined(BJ_ISA_AVX512) && !defined(__AVX512VNNI__))
constexpr bool SIGN_TRICK_8BIT = true;  // 8-bit codes through vpmaddubsw: |q| and q's sign (scaled_mm.cpp)
#else
constexpr bool SIGN_TRICK_8BIT = false;
#endif

template <typename T>
inline float block_factor(const T* x, int len, float* scale) {
  vf amax = vzero();
  for (int i = 0; i < len; i += 16) amax = vmax(amax, vabs(vload(x + i, ALL)));
  const float a = reduce_max(amax);
  *scale = a > 0.0f ? a / 127.0f : 1.0f;
  return a > 0.0f ? (1.0f / a) * 127.0f : 1.0f;
}

// a row's codes (q, or |q| and its signs for the AVX2 8-bit kernel), its block scales xs [k / ablk], and per fp32 step
// ci (symmetric: what the step's int32 sum loses: offset * qsum, or the sign trick's negative codes) or cf (with mins:
// the step's qsum, times xs where the block scale applies per step)
template <typename T>
void prepare_row(const T* x, const Format& f, int k, bool sign8, uint8_t* q, float* xs, int32_t* ci, float* cf) {
  const int epi = f.epi(), ablk = f.ablk();
  for (int b = 0; b < k / ablk; ++b) {
    const vf inv = vset(block_factor(x + b * ablk, ablk, xs + b));
    for (int at = b * ablk; at < (b + 1) * ablk; at += 16) {
      const vi c = to_int_trunc(vmin(vmax(round_even(vload(x + at, ALL) * inv), vset(-127.0f)), vset(127.0f)));
      int32_t sum;
      if (!sign8) {
        store_bytes(q + at, c, ALL);
        sum = reduce_add(c);
      } else {
        int32_t lanes[16], neg = 0;  // |q|, then q's sign as 0x7f (q < 0) or 0x80: u ^ it is q_w * sign (u ^ 0x80 = q_w)
        vstore_i(lanes, c);
        for (int i = 0; i < 16; ++i) {
          q[at + i] = (uint8_t)(lanes[i] < 0 ? -lanes[i] : lanes[i]);
          q[k + at + i] = lanes[i] < 0 ? 0x7f : 0x80;
          neg += lanes[i] < 0 ? lanes[i] : 0;
        }
        sum = neg;  // |q| * ~w = q * w + q where q < 0: the sum gains the negative codes
      }
      const int e = at / epi;  // 16 values lie in one step (steps are 16 or 32 long)
      if (at % epi == 0) {
        if (f.sym()) ci[e] = 0;
        else cf[e] = 0.0f;
      }
      if (f.sym()) ci[e] += sign8 ? sum : f.offset * sum;
      else cf[e] += (float)sum;  // exact: |sum| < 2**24
    }
    if (!f.sym() && !f.super())
      for (int e = b * ablk / epi; e < (b + 1) * ablk / epi; ++e) cf[e] = xs[b] * cf[e];
  }
}

// ---- per block of 64 columns, per span of up to 256 k: the exact int32 sums of each step, then the fp32 steps ----
// A span's codes (expanded: at most 16 KB) and scales stay in L1 while every row tile goes past them; a row's fp32
// accumulators wait in `acc` ([m][64], per thread) between spans, and the last span writes the output.
constexpr int SPAN = 256;

struct Tile {
  const uint8_t* codes;  // the span's [kc / 4][64][4] bytes, or (packed) its packed chunks, `ccb` bytes each
  const float* d;        // [kc / epi][64]
  const float* m;        // [kc / epi][64] or null
  int cols;              // real columns (<= 64)
  int k0, kc;            // the span's k values
  float* acc;            // [rows][64]: the accumulators between spans
  bool first, last;
  bool packed = false;   // codes unpacked in registers (a call of FUSE_ROWS rows or fewer: no tile to amortize)
  int bits = 8;
  int64_t ccb = 0;
};

template <typename T>
inline void store_out(T* out, vf acc, const float* bias, m16 mask) {
  if (bias) acc = acc + vload(bias, mask);
  vstore(out, acc, mask);
}

#if defined(BJ_ISA_AVX512) && defined(__AVX512VNNI__)
// ---- AVX512-VNNI: MR rows x 64 columns (4 zmm): MR x 4 int32 sums + MR x 4 fp32 accumulators ----
#define BJ_QKERNEL "avx512-vnni"
constexpr int FUSE_ROWS = 2;  // calls of this many rows or fewer unpack the nibbles in registers (decode of a row)

// one quad pair (8 k) of the packed chunk `src`, 64 columns: its two quads' codes as bytes (lo: quad 2p, hi: 2p + 1)
inline void unpack_pair(const uint8_t* src, int p, int bits, __m512i lo[4], __m512i hi[4]) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint64_t* planes = (const uint64_t*)(src + 1024);
  for (int j = 0; j < 4; ++j) {
    const __m512i x = _mm512_loadu_si512(src + p * 256 + 64 * j);
    lo[j] = _mm512_and_si512(x, low);
    hi[j] = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
    for (int e = 0; e < bits - 4; ++e) {
      const __m512i bit = _mm512_set1_epi8((char)(0x10 << e));
      lo[j] = _mm512_or_si512(lo[j], _mm512_maskz_mov_epi8(planes[(e * 8 + 2 * p) * 4 + j], bit));
      hi[j] = _mm512_or_si512(hi[j], _mm512_maskz_mov_epi8(planes[(e * 8 + 2 * p + 1) * 4 + j], bit));
    }
  }
}

// SB (the K-quants): the block scale is the span's (256 = one activation block): the steps sum without it, and it
// applies once at the span's end; else per step.
template <int MR, bool SYM, int EPI, bool SB, typename T>
void row_tile(const Tile& t, const Rows& R, int r0, int k, const float* bias, T* out, int64_t ldo) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j)
      acc[r][j] = SB || t.first ? _mm512_setzero_ps() : _mm512_loadu_ps(t.acc + (r0 + r) * NB + 16 * j);
  const int steps = t.kc / EPI, e0 = t.k0 / EPI;
  for (int e = 0; e < steps; ++e) {
    __m512i s[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j) s[r][j] = _mm512_setzero_si512();
    if (MR <= FUSE_ROWS && t.packed) {  // the step's quad pairs unpacked in registers
      const int ch = e * EPI / CHUNK, p0 = (e * EPI % CHUNK) / 8;
      const uint8_t* src = t.codes + ch * t.ccb;
      for (int p = p0; p < p0 + EPI / 8; ++p) {
        __m512i lo[4], hi[4];
        unpack_pair(src, p, t.bits, lo, hi);
        const int kk = t.k0 + ch * CHUNK + p * 8;
        for (int r = 0; r < MR; ++r) {
          int32_t a4[2];
          memcpy(a4, R.q + (r0 + r) * R.q_stride + kk, 8);
          const __m512i a0 = _mm512_set1_epi32(a4[0]), a1 = _mm512_set1_epi32(a4[1]);
          for (int j = 0; j < 4; ++j) s[r][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[r][j], lo[j], a0), hi[j], a1);
        }
      }
    } else {
    const uint8_t* w = t.codes + (int64_t)e * (EPI / 4) * 256;
#pragma GCC unroll 8
    for (int qd = 0; qd < EPI / 4; ++qd, w += 256) {
      const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64), w2 = _mm512_loadu_si512(w + 128),
                    w3 = _mm512_loadu_si512(w + 192);
      const int kk = t.k0 + e * EPI + qd * 4;
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        int32_t a4;
        memcpy(&a4, R.q + (r0 + r) * R.q_stride + kk, 4);
        const __m512i a = _mm512_set1_epi32(a4);
        s[r][0] = _mm512_dpbusd_epi32(s[r][0], w0, a);
        s[r][1] = _mm512_dpbusd_epi32(s[r][1], w1, a);
        s[r][2] = _mm512_dpbusd_epi32(s[r][2], w2, a);
        s[r][3] = _mm512_dpbusd_epi32(s[r][3], w3, a);
      }
    }
    }
    const float* d = t.d + e * NB;
    const float* m = SYM ? nullptr : t.m + e * NB;
    const int step = e0 + e;
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const int row = r0 + r;
      const __m512 xs = _mm512_set1_ps(SB ? 1.0f : R.xs[row * R.nblk + step * EPI / CHUNK]);
      if (SYM) {
        const __m512i c = _mm512_set1_epi32(R.ci[row * R.steps + step]);
        for (int j = 0; j < 4; ++j) {
          __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(s[r][j], c));
          if (!SB) v = _mm512_mul_ps(v, xs);
          acc[r][j] = _mm512_fmadd_ps(v, _mm512_loadu_ps(d + 16 * j), acc[r][j]);
        }
      } else {
        const __m512 c = _mm512_set1_ps(R.cf[row * R.steps + step]);
        for (int j = 0; j < 4; ++j) {
          __m512 v = _mm512_cvtepi32_ps(s[r][j]);
          if (!SB) v = _mm512_mul_ps(v, xs);
          acc[r][j] = _mm512_fmadd_ps(v, _mm512_loadu_ps(d + 16 * j), acc[r][j]);
          acc[r][j] = _mm512_fmadd_ps(_mm512_loadu_ps(m + 16 * j), c, acc[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    const __m512 xs = _mm512_set1_ps(SB ? R.xs[(r0 + r) * R.nblk + t.k0 / 256] : 1.0f);
    for (int j = 0; j < 4; ++j) {
      float* mem = t.acc + (r0 + r) * NB + 16 * j;
      __m512 a = acc[r][j];
      if (SB) a = t.first ? _mm512_mul_ps(a, xs) : _mm512_fmadd_ps(a, xs, _mm512_loadu_ps(mem));
      if (!t.last) _mm512_storeu_ps(mem, a);
      else if (16 * j < t.cols)
        store_out(out + (r0 + r) * ldo + 16 * j, vf{a}, bias ? bias + 16 * j : nullptr, tail(t.cols, 16 * j));
    }
  }
}

template <bool SYM, int EPI, bool SB, typename T>
void tile_rows(int, const Tile& t, const Rows& R, int m, int k, const float* bias, T* out, int64_t ldo) {
  int r = 0;
  for (; r + 3 <= m; r += 3) row_tile<3, SYM, EPI, SB>(t, R, r, k, bias, out, ldo);
  if (m - r == 2) row_tile<2, SYM, EPI, SB>(t, R, r, k, bias, out, ldo);
  else if (m - r == 1) row_tile<1, SYM, EPI, SB>(t, R, r, k, bias, out, ldo);
}

#elif defined(BJ_ISA_AVX512) || defined(BJ_ISA_AVX2)
// ---- AVX2 (and AVX-512 without VNNI): MR rows x 16 columns (2 ymm of 8 columns x 4 bytes a quad) ----
// Codes of at most 6 bits: vpmaddubsw(u, q) (a pair <= 2 * 63 * 127: no saturation) summed in int16 over FLUSH quads
// (4-bit: 8, 5-bit: 4, 6-bit: 2: a lane stays <= 32767), then vpmaddwd by ones into the int32 sum. 8-bit codes: the
// row as |q| and q's sign, the code's byte flipped by it (scaled_mm.cpp's trick), one quad at a time.
#define BJ_QKERNEL "avx2"
constexpr int FUSE_ROWS = 0;

// h += t in int16 lanes, as a GCC vector operation: with _mm256_add_epi16 GCC 12 adds into a fresh register and copies
// it back every quad (a vmovdqa an accumulator, against the dispatch width; scaled_mm.cpp's add_to says the same)
typedef short v16hi __attribute__((vector_size(32)));
inline void add16_to(__m256i& h, __m256i t) { h = (__m256i)((v16hi)h + (v16hi)t); }

template <int MR, bool SYM, int EPI, bool SB, int BITS, typename T>
void row_tile16(const Tile& t, const Rows& R, int r0, int c0, int k, const float* bias, T* out, int64_t ldo) {
  constexpr int LANE_QUADS = BITS == 4 ? 8 : BITS == 5 ? 4 : BITS == 6 ? 2 : 1;
  constexpr int FLUSH = LANE_QUADS < EPI / 4 ? LANE_QUADS : EPI / 4;
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 2; ++j)
      acc[r][j] = SB || t.first ? _mm256_setzero_ps() : _mm256_loadu_ps(t.acc + (r0 + r) * NB + c0 + 8 * j);
  const __m256i ones = _mm256_set1_epi16(1);
  const int steps = t.kc / EPI, e0 = t.k0 / EPI;
  for (int e = 0; e < steps; ++e) {
    __m256i s[MR][2];
    for (int r = 0; r < MR; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
    const uint8_t* w = t.codes + (int64_t)e * (EPI / 4) * 256 + c0 * 4;
    for (int q0 = 0; q0 < EPI / 4; q0 += FLUSH) {
      __m256i h[MR][2];
      for (int r = 0; r < MR; ++r) h[r][0] = h[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
      for (int i = 0; i < FLUSH; ++i) {
        const int qd = q0 + i;
        const __m256i w0 = _mm256_loadu_si256((const __m256i*)(w + qd * 256)),
                      w1 = _mm256_loadu_si256((const __m256i*)(w + qd * 256 + 32));
        const int kk = t.k0 + e * EPI + qd * 4;
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const uint8_t* a = R.q + (r0 + r) * R.q_stride + kk;
          int32_t a4;
          memcpy(&a4, a, 4);
          const __m256i av = _mm256_set1_epi32(a4);
          if constexpr (BITS == 8) {
            int32_t s4;
            memcpy(&s4, a + k, 4);
            const __m256i sg = _mm256_set1_epi32(s4);
            add16_to(h[r][0], _mm256_maddubs_epi16(av, _mm256_xor_si256(w0, sg)));
            add16_to(h[r][1], _mm256_maddubs_epi16(av, _mm256_xor_si256(w1, sg)));
          } else {
            add16_to(h[r][0], _mm256_maddubs_epi16(w0, av));
            add16_to(h[r][1], _mm256_maddubs_epi16(w1, av));
          }
        }
      }
      for (int r = 0; r < MR; ++r) {
        s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(h[r][0], ones));
        s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(h[r][1], ones));
      }
    }
    const float* d = t.d + e * NB + c0;
    const float* m = SYM ? nullptr : t.m + e * NB + c0;
    const int step = e0 + e;
    for (int r = 0; r < MR; ++r) {
      const int row = r0 + r;
      const __m256 xs = _mm256_set1_ps(SB ? 1.0f : R.xs[row * R.nblk + step * EPI / CHUNK]);
      if (SYM) {
        const __m256i c = _mm256_set1_epi32(R.ci[row * R.steps + step]);
        for (int j = 0; j < 2; ++j) {
          __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(s[r][j], c));
          if (!SB) v = _mm256_mul_ps(v, xs);
          acc[r][j] = _mm256_fmadd_ps(v, _mm256_loadu_ps(d + 8 * j), acc[r][j]);
        }
      } else {
        const __m256 c = _mm256_set1_ps(R.cf[row * R.steps + step]);
        for (int j = 0; j < 2; ++j) {
          __m256 v = _mm256_cvtepi32_ps(s[r][j]);
          if (!SB) v = _mm256_mul_ps(v, xs);
          acc[r][j] = _mm256_fmadd_ps(v, _mm256_loadu_ps(d + 8 * j), acc[r][j]);
          acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(m + 8 * j), c, acc[r][j]);
        }
      }
    }
  }
  const int cols = std::min(16, t.cols - c0);
  for (int r = 0; r < MR; ++r) {
    const __m256 xs = _mm256_set1_ps(SB ? R.xs[(r0 + r) * R.nblk + t.k0 / 256] : 1.0f);
    for (int j = 0; j < 2; ++j) {
      float* mem = t.acc + (r0 + r) * NB + c0 + 8 * j;
      if (SB) acc[r][j] = t.first ? _mm256_mul_ps(acc[r][j], xs) : _mm256_fmadd_ps(acc[r][j], xs, _mm256_loadu_ps(mem));
      if (!t.last) _mm256_storeu_ps(mem, acc[r][j]);
    }
    if (!t.last) continue;
#if defined(BJ_ISA_AVX512)
    const vf v{_mm512_insertf32x8(_mm512_castps256_ps512(acc[r][0]), acc[r][1], 1)};
#else
    const vf v{acc[r][0], acc[r][1]};
#endif
    store_out(out + (r0 + r) * ldo + c0, v, bias ? bias + c0 : nullptr, tail(cols, 0));
  }
}

template <bool SYM, int EPI, bool SB, int BITS, typename T>
void tile_rows_bits(const Tile& t, const Rows& R, int m, int k, const float* bias, T* out, int64_t ldo) {
  for (int c0 = 0; c0 < (t.last ? t.cols : NB); c0 += 16) {
    int r = 0;
    for (; r + 3 <= m; r += 3) row_tile16<3, SYM, EPI, SB, BITS>(t, R, r, c0, k, bias, out, ldo);
    if (m - r == 2) row_tile16<2, SYM, EPI, SB, BITS>(t, R, r, c0, k, bias, out, ldo);
    else if (m - r == 1) row_tile16<1, SYM, EPI, SB, BITS>(t, R, r, c0, k, bias, out, ldo);
  }
}

template <bool SYM, int EPI, bool SB, typename T>
void tile_rows(int bits, const Tile& t, const Rows& R, int m, int k, const float* bias, T* out, int64_t ldo) {
  switch (bits) {
    case 4: tile_rows_bits<SYM, EPI, SB, 4>(t, R, m, k, bias, out, ldo); break;
    case 5: tile_rows_bits<SYM, EPI, SB, 5>(t, R, m, k, bias, out, ldo); break;
    case 6: tile_rows_bits<SYM, EPI, SB, 6>(t, R, m, k, bias, out, ldo); break;
    default: tile_rows_bits<SYM, EPI, SB, 8>(t, R, m, k, bias, out, ldo); break;
  }
}

#else
// ---- generic: plain int32 loops, one row x 64 columns at a time; the same fp32 steps lane by lane ----
#define BJ_QKERNEL "generic"
constexpr int FUSE_ROWS = 0;

template <bool SYM, int EPI, bool SB, typename T>
void tile_rows(int, const Tile& t, const Rows& R, int m, int k, const float* bias, T* out, int64_t ldo) {
  const int steps = t.kc / EPI, e0 = t.k0 / EPI;
  for (int row = 0; row < m; ++row) {
    float* mem = t.acc + row * NB;
    float acc[NB];
    for (int c = 0; c < NB; ++c) acc[c] = SB || t.first ? 0.0f : mem[c];
    const int8_t* a = (const int8_t*)(R.q + row * R.q_stride);
    for (int e = 0; e < steps; ++e) {
      int32_t s[NB] = {};
      for (int qd = 0; qd < EPI / 4; ++qd) {
        const uint8_t* w = t.codes + ((int64_t)e * (EPI / 4) + qd) * 256;
        const int kk = t.k0 + e * EPI + qd * 4;
        for (int c = 0; c < NB; ++c)
          s[c] += w[4 * c] * a[kk] + w[4 * c + 1] * a[kk + 1] + w[4 * c + 2] * a[kk + 2] + w[4 * c + 3] * a[kk + 3];
      }
      const int step = e0 + e;
      const float xs = SB ? 1.0f : R.xs[row * R.nblk + step * EPI / CHUNK];
      for (int c = 0; c < NB; ++c) {
        if (SYM) {
          float v = (float)(s[c] - R.ci[row * R.steps + step]);
          if (!SB) v = v * xs;
          acc[c] = __builtin_fmaf(v, t.d[e * NB + c], acc[c]);
        } else {
          float v = (float)s[c];
          if (!SB) v = v * xs;
          acc[c] = __builtin_fmaf(v, t.d[e * NB + c], acc[c]);
          acc[c] = __builtin_fmaf(t.m[e * NB + c], R.cf[row * R.steps + step], acc[c]);
        }
      }
    }
    if (SB) {
      const float xs = R.xs[row * R.nblk + t.k0 / 256];
      for (int c = 0; c < NB; ++c) acc[c] = t.first ? acc[c] * xs : __builtin_fmaf(acc[c], xs, mem[c]);
    }
    if (!t.last)
      for (int c = 0; c < NB; ++c) mem[c] = acc[c];
    else
      for (int c = 0; c < t.cols; c += 16) store_out(out + row * ldo + c, vload(acc + c), bias ? bias + c : nullptr, tail(t.cols, c));
  }
}
#endif

template <typename T>
void run_tile(const Format& f, const Tile& t, const Rows& R, int m, int k, const float* bias, T* out, int64_t ldo) {
  if (f.kind == K6) tile_rows<true, 16, true>(f.bits, t, R, m, k, bias, out, ldo);          // Q6_K
  else if (f.kind == KQ) tile_rows<false, 32, true>(f.bits, t, R, m, k, bias, out, ldo);    // Q4_K, Q5_K
  else if (f.sym()) tile_rows<true, 32, false>(f.bits, t, R, m, k, bias, out, ldo);         // Q4_0, Q5_0, Q8_0, int4
  else tile_rows<false, 32, false>(f.bits, t, R, m, k, bias, out, ldo);                     // Q4_1, Q5_1
}

template <typename X, typename T>
int qlinear(const X* x, int64_t stride, int m, int k, const Format& f, const uint8_t* codes, const uint8_t* scales,
            int n, const float* bias, T* out, int64_t ldo, int threads) {
  const bool sign8 = SIGN_TRICK_8BIT && f.bits == 8;
  const int steps = k / f.epi(), epi = f.epi(), nblk = k / f.ablk();
  Rows R{k, steps, nblk, sign8 ? 2 * (int64_t)k : (int64_t)k, nullptr, nullptr, nullptr, nullptr};
  // the rows' codes and scales: scratch kept by the calling thread, grown as needed
  static thread_local std::vector<uint8_t> qbuf;
  static thread_local std::vector<float> fbuf;
  static thread_local std::vector<int32_t> ibuf;
  if ((int64_t)qbuf.size() < m * R.q_stride + 64) qbuf.resize(m * R.q_stride + 64);
  if ((int64_t)fbuf.size() < (int64_t)m * (nblk + steps)) fbuf.resize((int64_t)m * (nblk + steps));
  if ((int64_t)ibuf.size() < (int64_t)m * steps) ibuf.resize((int64_t)m * steps);
  R.q = qbuf.data();
  R.xs = fbuf.data();
  R.cf = fbuf.data() + (int64_t)m * nblk;
  R.ci = ibuf.data();
  const int blocks = (n + NB - 1) / NB;
  const int64_t ccb = f.chunk_code_bytes(), cb = ccb * (k / CHUNK), sb = f.scale_bytes(k);
  const int nt = (int64_t)m * n * k >= (1 << 18) ? threads : 1;
  const bool fused = !f.byte_codes() && m <= FUSE_ROWS;  // few rows: no tile (its stores and loads cost more than it saves)
  // rows a panel: at most 768 (their accumulators and a span of their codes, 2 x 192 KB, stay in L2) and about 4 MB of
  // codes (in L3 beside the weights' stream); the panels of a call even (a multiple of 6: every path's row tiles)
  const int most = std::max(96, std::min(768, (int)((4 << 20) / R.q_stride))), panels = (m + most - 1) / most;
  const int panel = ((m + panels - 1) / panels + 5) / 6 * 6;
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (int r = 0; r < m; ++r)
      prepare_row(x + r * stride, f, k, sign8, R.q + r * R.q_stride, R.xs + (int64_t)r * nblk,
                  R.ci + (int64_t)r * steps, R.cf + (int64_t)r * steps);
    // per thread, kept for the next call: a span's expanded codes and fp32 scales, the rows' accumulators
    static thread_local std::vector<uint8_t> tile;
    static thread_local std::vector<float> dm, acc;
    if (tile.size() < (size_t)SPAN * NB) tile.resize((size_t)SPAN * NB);
    if (dm.size() < (size_t)(SPAN / 16) * NB * 2) dm.resize((size_t)(SPAN / 16) * NB * 2);
    if (acc.size() < (size_t)std::min(m, panel) * NB) acc.resize((size_t)std::min(m, panel) * NB);
    float* d = dm.data();
    float* mn = f.sym() ? nullptr : dm.data() + (SPAN / 16) * NB;
    // rows in panels whose codes stay in L2/L3 while every block goes past them (a block's tile is expanded once a
    // panel: a few percent of its work)
    for (int p0 = 0; p0 < m; p0 += panel) {
      const int pm = std::min(panel, m - p0);
      Rows P = R;
      P.q += p0 * R.q_stride;
      P.xs += (int64_t)p0 * nblk;
      P.ci += (int64_t)p0 * steps;
      P.cf += (int64_t)p0 * steps;
#pragma omp for schedule(static)
      for (int b = 0; b < blocks; ++b) {
        const uint8_t* c = codes + b * cb;
        for (int k0 = 0; k0 < k; k0 += SPAN) {
          const int kc = std::min(SPAN, k - k0);
          if (!f.byte_codes() && !fused)
            for (int ch = 0; ch < kc / CHUNK; ++ch)
              expand_chunk(c + (k0 / CHUNK + ch) * ccb, f.bits, tile.data() + ch * CHUNK * NB);
          expand_scales(f, scales + b * sb, k0 / epi, (k0 + kc) / epi, d, mn);
          const bool as_packed = f.byte_codes() || fused;
          const Tile t{as_packed ? c + (k0 / CHUNK) * ccb : tile.data(), d, mn, std::min(NB, n - b * NB), k0, kc,
                       acc.data(), k0 == 0, k0 + kc == k, fused, f.bits, ccb};
          run_tile(f, t, P, pm, k, bias ? bias + b * NB : nullptr, out + p0 * ldo + b * NB, ldo);
        }
      }
    }
  }
  return 0;
}

template <typename X>
int qlinear_to(const X* x, int64_t stride, int m, int k, const Format& f, const uint8_t* codes, const uint8_t* scales,
               int n, const float* bias, void* out, int64_t ldo, int odtype, int threads) {
  if (odtype == 0) return qlinear(x, stride, m, k, f, codes, scales, n, bias, (float*)out, ldo, threads);
  if (odtype == 1) return qlinear(x, stride, m, k, f, codes, scales, n, bias, (uint16_t*)out, ldo, threads);
  return 1;
}

// ---- packing ---------------------------------------------------------------------------------------------------
// place code u of (column c of its block, k index kk within its chunk) into a chunk's packed bytes
inline void put_code(uint8_t* chunk, int bits, int c, int kk, uint8_t u) {
  const int quad = kk / 4, j = kk % 4, i = c * 4 + j;  // byte i of the quad
  if (bits >= 6) {  // Format::byte_codes
    chunk[quad * 256 + i] = u;
    return;
  }
  const int pair = quad / 2;
  chunk[pair * 256 + i] |= (uint8_t)((u & 0x0F) << (quad % 2 ? 4 : 0));
  for (int e = 0; e < bits - 4; ++e)
    if ((u >> (4 + e)) & 1) chunk[1024 + e * 256 + quad * 32 + i / 8] |= (uint8_t)(1u << (i % 8));
}

// GGUF types (gguf.GGMLQuantizationType)
enum GgufType { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

inline bool gguf_format(int type, Format* f, int* block, int* block_bytes) {
  switch (type) {
    case Q4_0: *f = {4, 32, 8, F16}; *block = 32; *block_bytes = 18; return true;
    case Q4_1: *f = {4, 32, -1, F16}; *block = 32; *block_bytes = 20; return true;
    case Q5_0: *f = {5, 32, 16, F16}; *block = 32; *block_bytes = 22; return true;
    case Q5_1: *f = {5, 32, -1, F16}; *block = 32; *block_bytes = 24; return true;
    case Q8_0: *f = {8, 32, 128, F16}; *block = 32; *block_bytes = 34; return true;
    case Q4_K: *f = {4, 32, -1, KQ}; *block = 256; *block_bytes = 144; return true;
    case Q5_K: *f = {5, 32, -1, KQ}; *block = 256; *block_bytes = 176; return true;
    case Q6_K: *f = {6, 16, 32, K6}; *block = 256; *block_bytes = 210; return true;
    default: return false;
  }
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 scale bytes (gguf Q4_K.get_scale_min)
inline void k_scale_min(const uint8_t* s, int j, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (uint8_t)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
    *mn = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// one GGUF block of column c (block-relative) at k0 into the packed codes (chunks of this column block) and scales
void pack_gguf_block(int type, const uint8_t* blk, const Format& f, int c, int k0, uint8_t* codes, uint8_t* scales) {
  uint8_t u[256];
  const int64_t ccb = f.chunk_code_bytes();
  switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: {
      const int head = type == Q4_0 || type == Q8_0 ? 2 : type == Q5_0 ? 6 : type == Q4_1 ? 4 : 8;  // bytes before qs
      uint32_t qh = 0;
      if (type == Q5_0) memcpy(&qh, blk + 2, 4);
      if (type == Q5_1) memcpy(&qh, blk + 4, 4);
      for (int i = 0; i < 32; ++i) {
        if (type == Q8_0) { u[i] = (uint8_t)((int8_t)blk[2 + i] + 128); continue; }
        const uint8_t b = blk[head + (i % 16)];
        u[i] = (uint8_t)((i < 16 ? b & 0x0F : b >> 4) | (((qh >> i) & 1) << 4));
      }
      const int g = k0 / 32;
      uint8_t* s = scales + (int64_t)g * NB * 2 * (f.sym() ? 1 : 2);
      memcpy(s + 2 * c, blk, 2);                      // d
      if (!f.sym()) memcpy(s + NB * 2 + 2 * c, blk + 2, 2);  // m
      for (int i = 0; i < 32; ++i) put_code(codes + (k0 / CHUNK) * ccb, f.bits, c, i, u[i]);
      return;
    }
    case Q4_K: case Q5_K: {
      const uint8_t* sc12 = blk + 4;
      const uint8_t* qh = type == Q5_K ? blk + 16 : nullptr;
      const uint8_t* qs = blk + (type == Q5_K ? 48 : 16);
      for (int j = 0; j < 8; ++j)      // sub-block j: qs[32 * (j / 2) + l], low nibble for even j
        for (int l = 0; l < 32; ++l) {
          const uint8_t b = qs[32 * (j / 2) + l];
          u[32 * j + l] = (uint8_t)((j % 2 ? b >> 4 : b & 0x0F) | (qh ? ((qh[l] >> j) & 1) << 4 : 0));
        }
      uint8_t* s = scales + (int64_t)(k0 / 256) * (NB * 4 + 8 * NB * 2);
      memcpy(s + 2 * c, blk, 2);
      memcpy(s + NB * 2 + 2 * c, blk + 2, 2);
      for (int j = 0; j < 8; ++j) k_scale_min(sc12, j, s + NB * 4 + j * NB * 2 + c, s + NB * 4 + j * NB * 2 + NB + c);
      break;
    }
    case Q6_K: {
      const uint8_t *ql = blk, *qh = blk + 128, *sc = blk + 192, *d = blk + 208;
      for (int e = 0; e < 256; ++e) {  // gguf's order: half h, then (l: 64 values of ql, 32 of qh)
        const int h = e / 128, r = e % 128, s2 = r / 32, l = r % 32;
        const int lq = 64 * h + (s2 % 2) * 32 + l, sh = s2 / 2;  // ql byte and nibble for sub32 (4h + s2)
        const uint8_t lo = (uint8_t)((ql[lq] >> (4 * sh)) & 0x0F);
        const uint8_t hi = (uint8_t)((qh[32 * h + l] >> (2 * s2)) & 3);
        u[e] = (uint8_t)(lo | (hi << 4));
      }
      uint8_t* s = scales + (int64_t)(k0 / 256) * (NB * 2 + 16 * NB);
      memcpy(s + 2 * c, d, 2);
      for (int j = 0; j < 16; ++j) s[NB * 2 + j * NB + c] = sc[j];
      break;
    }
  }
  for (int e = 0; e < 256; ++e) put_code(codes + ((k0 + e) / CHUNK) * ccb, f.bits, c, (k0 + e) % CHUNK, u[e]);
}

}  // namespace

// the micro-kernel this build runs: "avx512-vnni", "avx2" or "generic"
extern "C" const char* bj_qlinear_kernel() { return BJ_QKERNEL; }

// bytes of the packed codes and scales of an [n, k] weight in format (bits, group, offset, kind); 0 if refused
extern "C" int64_t bj_qpacked_bytes(int bits, int group, int offset, int kind, int n, int k, int scales) {
  const Format f{bits, group, offset, kind};
  if (!valid(f, k) || n <= 0) return 0;
  const int64_t blocks = (n + NB - 1) / NB;
  return blocks * (scales ? f.scale_bytes(k) : f.chunk_code_bytes() * (k / CHUNK));
}

// the format of a GGUF type: fills bits, group, offset, kind; returns 0, or 1 for a type not computed as stored
extern "C" int bj_qgguf_format(int type, int* out4) {
  Format f;
  int block, bytes;
  if (!gguf_format(type, &f, &block, &bytes)) return 1;
  out4[0] = f.bits; out4[1] = f.group; out4[2] = f.offset; out4[3] = f.kind;
  return 0;
}

// raw GGUF rows [n][row_bytes] (row r: output column r's k / block blocks) -> packed codes and scales (zeroed here)
extern "C" int bj_qpack_gguf(int type, const uint8_t* raw, int64_t row_bytes, int n, int k, uint8_t* codes,
                             uint8_t* scales, int threads) {
  Format f;
  int block, bytes;
  if (!gguf_format(type, &f, &block, &bytes) || !valid(f, k) || k % block || row_bytes != (int64_t)(k / block) * bytes)
    return 1;
  const int blocks = (n + NB - 1) / NB;
  const int64_t cb = f.chunk_code_bytes() * (k / CHUNK), sb = f.scale_bytes(k);
  memset(codes, 0, blocks * cb);
  memset(scales, 0, blocks * sb);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int b = 0; b < blocks; ++b)
    for (int c = 0; c < NB && b * NB + c < n; ++c) {
      const uint8_t* row = raw + (int64_t)(b * NB + c) * row_bytes;
      for (int i = 0; i < k / block; ++i)
        pack_gguf_block(type, row + (int64_t)i * bytes, f, c, i * block, codes + b * cb, scales + b * sb);
    }
  return 0;
}

// unsigned codes u [n][k] and fp32 d (and m: null for symmetric) [n][k / group] -> packed, kind F32 (int4 and the
// like: bits 4..8, group a multiple of 32)
extern "C" int bj_qpack_codes(int bits, int group, int offset, const uint8_t* u, const float* d, const float* m, int n,
                              int k, uint8_t* codes, uint8_t* scales, int threads) {
  const Format f{bits, group, offset, F32};
  if (!valid(f, k) || (m == nullptr) != f.sym()) return 1;
  const int blocks = (n + NB - 1) / NB, groups = k / group;
  const int64_t cb = f.chunk_code_bytes() * (k / CHUNK), sb = f.scale_bytes(k);
  memset(codes, 0, blocks * cb);
  memset(scales, 0, blocks * sb);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int b = 0; b < blocks; ++b)
    for (int c = 0; c < NB && b * NB + c < n; ++c) {
      const int64_t col = b * NB + c;
      for (int kk = 0; kk < k; ++kk) put_code(codes + b * cb + (kk / CHUNK) * f.chunk_code_bytes(), bits, c, kk % CHUNK, u[col * k + kk]);
      for (int g = 0; g < groups; ++g) {
        uint8_t* s = scales + b * sb + (int64_t)g * NB * 4 * (f.sym() ? 1 : 2);
        memcpy(s + 4 * c, d + col * groups + g, 4);
        if (m) memcpy(s + NB * 4 + 4 * c, m + col * groups + g, 4);
      }
    }
  return 0;
}

// x [m, k] (xdtype 0 fp32, 1 bf16; row stride `stride`) @ the packed weight [n, k] -> out [m, n] (odtype 0 fp32,
// 1 bf16; row stride ldo: a slice of a wider output), + bias fp32 [n] or null. Returns 0, or 1 for arguments it refuses.
extern "C" int bj_qlinear(const void* x, int64_t stride, int xdtype, int m, int k, int bits, int group, int offset,
                          int kind, const uint8_t* codes, const uint8_t* scales, int n, const float* bias, void* out,
                          int64_t ldo, int odtype, int threads) {
  const Format f{bits, group, offset, kind};
  if (!valid(f, k) || m < 0 || n <= 0 || stride < k || ldo < n) return 1;
  if (m == 0) return 0;
  if (xdtype == 0) return qlinear_to((const float*)x, stride, m, k, f, codes, scales, n, bias, out, ldo, odtype, threads);
  if (xdtype == 1) return qlinear_to((const uint16_t*)x, stride, m, k, f, codes, scales, n, bias, out, ldo, odtype, threads);
  return 1;
}

// columns ids[count] of the packed weight (rows of [n, k]) dequantized as gguf's dequantize computes them ->
// out [count, k] (odtype 0 fp32, 1 bf16)
extern "C" int bj_qdequant_cols(int bits, int group, int offset, int kind, const uint8_t* codes, const uint8_t* scales,
                                int n, int k, const int64_t* ids, int count, void* out, int odtype, int threads) {
  const Format f{bits, group, offset, kind};
  if (!valid(f, k) || (odtype != 0 && odtype != 1)) return 1;
  for (int i = 0; i < count; ++i)
    if (ids[i] < 0 || ids[i] >= n) return 2;
  const int64_t cb = f.chunk_code_bytes() * (k / CHUNK), sb = f.scale_bytes(k);
  const int steps = k / f.epi();
#pragma omp parallel num_threads(count * (int64_t)k >= 65536 ? threads : 1)
  {
    std::vector<float> d((size_t)steps * NB), mn((size_t)steps * NB), row(k);
    std::vector<uint8_t> tile(CHUNK * NB);
    int64_t last = -1;
#pragma omp for schedule(static)
    for (int i = 0; i < count; ++i) {
      const int64_t b = ids[i] / NB, c = ids[i] % NB;
      if (b != last) {
        expand_scales(f, scales + b * sb, 0, steps, d.data(), f.sym() ? nullptr : mn.data());
        last = b;
      }
      for (int ch = 0; ch < k / CHUNK; ++ch) {
        const uint8_t* src = codes + b * cb + ch * f.chunk_code_bytes();
        const uint8_t* t = src;
        if (!f.byte_codes()) {
          expand_chunk(src, f.bits, tile.data());
          t = tile.data();
        }
        for (int kk = 0; kk < CHUNK; ++kk) {
          const int at = ch * CHUNK + kk, e = at / f.epi();
          const float u = (float)t[(kk / 4) * 256 + c * 4 + kk % 4];
          const float de = d[e * NB + c];
          float v;
          if (f.kind == KQ) {
            v = de * u + mn[e * NB + c];  // gguf: d * sc * q - dmin * m (mn holds -(dmin * m))
          } else if (f.sym()) {
            v = de * (u - (float)f.offset);  // exact integer u - offset, as gguf's q - offset
          } else {
            v = de * u + mn[e * NB + c];
          }
          row[at] = v;
        }
      }
      if (odtype == 0) memcpy((float*)out + (int64_t)i * k, row.data(), (size_t)k * 4);
      else
        for (int kk = 0; kk < k; ++kk) ((uint16_t*)out)[(int64_t)i * k + kk] = bf16_bits(row[kk]);
    }
  }
  return 0;
}
