// The portable vector layer every CPU kernel is written against: `vf` (16 fp32 lanes), `vi` (16 int32 lanes) and
// `m16` (a 16-bit lane mask), on three instruction sets chosen at compile time by kernels/native/build.py:
//   BJ_ISA_AVX512  one zmm per vector (AVX-512 F/BW/VL/DQ; BF16 and VNNI used where the compiler targets them)
//   BJ_ISA_AVX2    two ymm per vector (AVX2 + FMA + F16C; AMD Zen 2/3, Intel client chips, older Xeons)
//   BJ_ISA_GENERIC plain C++ over float[16] (no intrinsics): what the compiler makes of it (NEON/SVE on Arm)
//
// Why our own thin layer, not ATen's at::vec or Highway (docs/design/kernels.md): the logical width is the same
// 16 lanes on every path, so every kernel keeps its tiles (16 keys, 16 dims), and every reduction has one fixed
// order (`hsum`'s tree, lane-wise everything else). The same instructions' meaning on every path makes the fp32
// results bitwise the same on all three (tests/kernels/test_native_kernels.py compares them), and no torch header
// is parsed (a build stays seconds). Each op states the AVX-512 instruction whose result it reproduces, NaN and
// signed-zero rules included (max/min return the second operand when either is NaN, as MAXPS does).
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(BJ_ISA_AVX512) + defined(BJ_ISA_AVX2) + defined(BJ_ISA_GENERIC) != 1
#error "compile with exactly one of -DBJ_ISA_AVX512, -DBJ_ISA_AVX2, -DBJ_ISA_GENERIC (kernels/native/build.py)"
#endif
#if defined(BJ_ISA_AVX512) && !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__))
#error "BJ_ISA_AVX512 needs -mavx512f -mavx512bw -mavx512vl -mavx512dq (or -march=native on such a CPU)"
#endif
#if defined(BJ_ISA_AVX2) && !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "BJ_ISA_AVX2 needs -mavx2 -mfma -mf16c (or -march=native on such a CPU)"
#endif
#if defined(BJ_ISA_AVX512) || defined(BJ_ISA_AVX2)
#include <immintrin.h>
#endif

namespace {

using m16 = uint32_t;  // bit i: lane i (the low 16 bits)
constexpr m16 ALL = 0xffff;

// lanes [0, n - i) of a run of n values starting at i (a loop's tail)
inline m16 tail(int n, int i) { return n - i >= 16 ? ALL : (m16)((1u << (n - i)) - 1u); }

inline uint32_t f2u(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
inline float u2f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

// fp32 -> bf16 bits, round to nearest even; NaN -> 0xffff (as ATen's vectorized conversion, which torch's CPU ops use)
inline uint16_t bf16_bits(float x) {
  const uint32_t u = f2u(x);
  if (x != x) return 0xffff;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_value(uint16_t b) { return u2f((uint32_t)b << 16); }

// fp32 <-> fp16, round to nearest even (the F16C instructions' results)
inline uint16_t fp16(float x) {
#if defined(__F16C__)
  return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const uint32_t u = f2u(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0u));
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds past 65504: infinity
  if (a < 0x38800000u) {  // a subnormal fp16 (or zero): round a's value to a multiple of 2^-24
    const float r = u2f(a) * 16777216.0f;  // exact: a power-of-two scaling
    const float ri = __builtin_rintf(r);   // nearest even
    return (uint16_t)(sign | (uint32_t)ri);
  }
  const uint32_t mant_round = a + 0xfffu + ((a >> 13) & 1u);
  return (uint16_t)(sign | ((mant_round - 0x38000000u) >> 13));
#endif
}
inline float fp32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) return u2f(sign | f2u((float)m * 5.960464477539063e-08f));  // m * 2^-24, exact
  if (e == 31) return u2f(sign | 0x7f800000u | (m << 13));
  return u2f(sign | ((e + 112u) << 23) | (m << 13));
#endif
}

// ================================================================================================================
#if defined(BJ_ISA_AVX512)

struct vf { __m512 v; };
struct vi { __m512i v; };

inline vf vzero() { return {_mm512_setzero_ps()}; }
inline vf vset(float x) { return {_mm512_set1_ps(x)}; }
inline vf vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline vf vload(const float* p, m16 m) { return {_mm512_maskz_loadu_ps((__mmask16)m, p)}; }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x.v); }
inline void vstore(float* p, vf x, m16 m) { _mm512_mask_storeu_ps(p, (__mmask16)m, x.v); }
inline vf operator+(vf a, vf b) { return {_mm512_add_ps(a.v, b.v)}; }
inline vf operator-(vf a, vf b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline vf operator*(vf a, vf b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline vf operator/(vf a, vf b) { return {_mm512_div_ps(a.v, b.v)}; }
inline vf fmadd(vf a, vf b, vf c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c, one rounding
inline vf vmax(vf a, vf b) { return {_mm512_max_ps(a.v, b.v)}; }
inline vf vmin(vf a, vf b) { return {_mm512_min_ps(a.v, b.v)}; }
inline vf vabs(vf a) { return {_mm512_abs_ps(a.v)}; }
inline vf copysign(vf mag, vf sgn) {  // mag >= +0
  return {_mm512_or_ps(mag.v, _mm512_and_ps(sgn.v, _mm512_set1_ps(-0.0f)))};
}
inline vf round_even(vf a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline vf scale2(vf p, vf e) { return {_mm512_scalef_ps(p.v, e.v)}; }  // p * 2^e, e integral in [-126, 127]
inline m16 lt(vf a, vf b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ); }
inline m16 gt(vf a, vf b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ); }
inline m16 eq(vf a, vf b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ); }
inline m16 isnan(vf a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }
inline vf select(m16 m, vf a, vf b) { return {_mm512_mask_blend_ps((__mmask16)m, a.v, b.v)}; }  // m ? b : a
inline vf keep(m16 m, vf a) { return {_mm512_maskz_mov_ps((__mmask16)m, a.v)}; }               // m ? a : 0
inline float reduce_max(vf a) { return _mm512_reduce_max_ps(a.v); }
inline float hsum(vf v) {  // the fixed tree: (i + i+8), then (+4), then (+2), then (+1)
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v.v), _mm512_extractf32x8_ps(v.v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}
// 16 bf16 values widened (exact)
inline vf vload_bf16(const uint16_t* p) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16))};
}
inline vf vload_bf16(const uint16_t* p, m16 m) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16((__mmask16)m, p)), 16))};
}
#if defined(__AVX512BF16__)
// one instruction (AVX512-BF16): nearest even, as below, except that a NaN stays a (quiet) NaN of another payload
// and a denormal input gives a signed zero (the instruction's DAZ; bf16 denormals under 1.2e-38)
inline __m256i bf16_pack(vf x) { return (__m256i)_mm512_cvtneps_pbh(x.v); }
#else
inline __m256i bf16_pack(vf x) {  // round to nearest even, NaN -> 0xffff
  const __m512i u = _mm512_castps_si512(x.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q), _mm512_set1_epi32(0xffff));
  return _mm512_cvtepi32_epi16(r);
}
#endif
inline void vstore_bf16(uint16_t* p, vf x) { _mm256_storeu_si256((__m256i*)p, bf16_pack(x)); }
inline vf round_bf16(vf x) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_pack(x)), 16))}; }
inline void vstore_bf16(uint16_t* p, vf x, m16 m) { _mm256_mask_storeu_epi16(p, (__mmask16)m, bf16_pack(x)); }
// 16 dwords, each a bf16 pair (even in the low half): acc + even * b.even + odd * b.odd per lane, fp32 sums
inline vf dot_bf16_pairs(vf acc, const uint32_t* pairs, uint32_t b) {
#if defined(__AVX512BF16__)
  return {_mm512_dpbf16_ps(acc.v, (__m512bh)_mm512_loadu_si512(pairs), (__m512bh)_mm512_set1_epi32((int)b))};
#else
  const __m512i x = _mm512_loadu_si512(pairs);
  const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
  acc.v = _mm512_fmadd_ps(even, _mm512_set1_ps(u2f(b << 16)), acc.v);
  return {_mm512_fmadd_ps(odd, _mm512_set1_ps(u2f(b & 0xffff0000u)), acc.v)};
#endif
}
// int32 lanes
inline vi vload_i(const int32_t* p) { return {_mm512_loadu_si512(p)}; }
inline vi vload_i(const int32_t* p, m16 m) { return {_mm512_maskz_loadu_epi32((__mmask16)m, p)}; }
inline void vstore_i(int32_t* p, vi x) { _mm512_storeu_si512(p, x.v); }
inline void vstore_i(int32_t* p, vi x, m16 m) { _mm512_mask_storeu_epi32(p, (__mmask16)m, x.v); }
inline vi iset(int32_t x) { return {_mm512_set1_epi32(x)}; }
inline vi iota() { return {_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)}; }
inline vi operator+(vi a, vi b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline vi operator-(vi a, vi b) { return {_mm512_sub_epi32(a.v, b.v)}; }
inline vi select(m16 m, vi a, vi b) { return {_mm512_mask_blend_epi32((__mmask16)m, a.v, b.v)}; }
inline int32_t reduce_min(m16 m, vi a) { return _mm512_mask_reduce_min_epi32((__mmask16)m, a.v); }
inline vf to_float(vi a) { return {_mm512_cvtepi32_ps(a.v)}; }  // nearest even
inline vi to_int_trunc(vf a) { return {_mm512_cvttps_epi32(a.v)}; }
// the low byte of each int32 lane (values already in [-128, 255]), 16 bytes
inline void store_bytes(void* p, vi x, m16 m) { _mm_mask_storeu_epi8(p, (__mmask16)m, _mm512_cvtepi32_epi8(x.v)); }

inline void prefetch_l2(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_T1); }

// ================================================================================================================
#elif defined(BJ_ISA_AVX2)

struct vf { __m256 a, b; };
struct vi { __m256i a, b; };

inline __m256i lanes8(uint32_t m8) {  // bit i of m8 -> lane i all ones
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)m8), bits), bits);
}
inline m16 mask_of(__m256 lo, __m256 hi) { return (m16)_mm256_movemask_ps(lo) | ((m16)_mm256_movemask_ps(hi) << 8); }

inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf vset(float x) { const __m256 v = _mm256_set1_ps(x); return {v, v}; }
inline vf vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline vf vload(const float* p, m16 m) {
  if (m == ALL) return vload(p);
  return {_mm256_maskload_ps(p, lanes8(m & 0xff)), _mm256_maskload_ps(p + 8, lanes8(m >> 8))};
}
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
inline void vstore(float* p, vf x, m16 m) {
  if (m == ALL) return vstore(p, x);
  _mm256_maskstore_ps(p, lanes8(m & 0xff), x.a);
  _mm256_maskstore_ps(p + 8, lanes8(m >> 8), x.b);
}
inline vf operator+(vf x, vf y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline vf operator-(vf x, vf y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
inline vf operator*(vf x, vf y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline vf operator/(vf x, vf y) { return {_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)}; }
inline vf fmadd(vf x, vf y, vf z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline vf vmax(vf x, vf y) { return {_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)}; }
inline vf vmin(vf x, vf y) { return {_mm256_min_ps(x.a, y.a), _mm256_min_ps(x.b, y.b)}; }
inline vf vabs(vf x) {
  const __m256 s = _mm256_set1_ps(-0.0f);
  return {_mm256_andnot_ps(s, x.a), _mm256_andnot_ps(s, x.b)};
}
inline vf copysign(vf mag, vf sgn) {
  const __m256 s = _mm256_set1_ps(-0.0f);
  return {_mm256_or_ps(mag.a, _mm256_and_ps(sgn.a, s)), _mm256_or_ps(mag.b, _mm256_and_ps(sgn.b, s))};
}
inline vf round_even(vf x) {
  constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.a, R), _mm256_round_ps(x.b, R)};
}
inline __m256 pow2(__m256 e) {  // 2^e for integral e in [-126, 127], exact
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(e), _mm256_set1_epi32(127)), 23));
}
inline vf scale2(vf p, vf e) { return {_mm256_mul_ps(p.a, pow2(e.a)), _mm256_mul_ps(p.b, pow2(e.b))}; }
#define BJ_CMP(name, pred) \
  inline m16 name(vf x, vf y) { return mask_of(_mm256_cmp_ps(x.a, y.a, pred), _mm256_cmp_ps(x.b, y.b, pred)); }
BJ_CMP(lt, _CMP_LT_OQ)
BJ_CMP(gt, _CMP_GT_OQ)
BJ_CMP(eq, _CMP_EQ_OQ)
#undef BJ_CMP
inline m16 isnan(vf x) { return mask_of(_mm256_cmp_ps(x.a, x.a, _CMP_UNORD_Q), _mm256_cmp_ps(x.b, x.b, _CMP_UNORD_Q)); }
inline vf select(m16 m, vf x, vf y) {
  return {_mm256_blendv_ps(x.a, y.a, _mm256_castsi256_ps(lanes8(m & 0xff))),
          _mm256_blendv_ps(x.b, y.b, _mm256_castsi256_ps(lanes8(m >> 8)))};
}
inline vf keep(m16 m, vf x) {
  return {_mm256_and_ps(x.a, _mm256_castsi256_ps(lanes8(m & 0xff))), _mm256_and_ps(x.b, _mm256_castsi256_ps(lanes8(m >> 8)))};
}
inline float reduce_max(vf x) {
  __m256 a = _mm256_max_ps(x.a, x.b);
  __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_max_ps(b, _mm_movehl_ps(b, b));
  b = _mm_max_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}
inline float hsum(vf x) {  // AVX-512's tree
  __m256 a = _mm256_add_ps(x.a, x.b);
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}
inline __m256 widen_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline vf vload_bf16(const uint16_t* p) {
  return {widen_bf16(_mm_loadu_si128((const __m128i*)p)), widen_bf16(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
inline vf vload_bf16(const uint16_t* p, m16 m) {
  if (m == ALL) return vload_bf16(p);
  alignas(32) uint16_t t[16] = {0};
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) t[i] = p[i];
  return vload_bf16(t);
}
inline __m256i bf16_round_bits(__m256 v) {  // fp32 bits rounded to bf16 (high half; nearest even; NaN -> 0xffff)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                                     _mm256_set1_epi32((int)0xffff0000u));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32((int)0xffff0000u), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline vf round_bf16(vf x) { return {_mm256_castsi256_ps(bf16_round_bits(x.a)), _mm256_castsi256_ps(bf16_round_bits(x.b))}; }
inline void vstore_bf16(uint16_t* p, vf x) {
  const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(bf16_round_bits(x.a), 16),
                                             _mm256_srli_epi32(bf16_round_bits(x.b), 16));  // a0-3 b0-3 | a4-7 b4-7
  _mm256_storeu_si256((__m256i*)p, _mm256_permute4x64_epi64(packed, 0xd8));
}
inline void vstore_bf16(uint16_t* p, vf x, m16 m) {
  if (m == ALL) return vstore_bf16(p, x);
  alignas(32) uint16_t t[16];
  vstore_bf16(t, x);
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) p[i] = t[i];
}
inline vf dot_bf16_pairs(vf acc, const uint32_t* pairs, uint32_t b) {
  const __m256 be = _mm256_set1_ps(u2f(b << 16)), bo = _mm256_set1_ps(u2f(b & 0xffff0000u));
  const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
  const __m256i x = _mm256_loadu_si256((const __m256i*)pairs), y = _mm256_loadu_si256((const __m256i*)(pairs + 8));
  acc.a = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), be, acc.a);
  acc.b = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(y, 16)), be, acc.b);
  acc.a = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(x, hi)), bo, acc.a);
  acc.b = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(y, hi)), bo, acc.b);
  return acc;
}
inline vi vload_i(const int32_t* p) { return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 8))}; }
inline vi vload_i(const int32_t* p, m16 m) {
  return {_mm256_maskload_epi32(p, lanes8(m & 0xff)), _mm256_maskload_epi32(p + 8, lanes8(m >> 8))};
}
inline void vstore_i(int32_t* p, vi x) { _mm256_storeu_si256((__m256i*)p, x.a); _mm256_storeu_si256((__m256i*)(p + 8), x.b); }
inline void vstore_i(int32_t* p, vi x, m16 m) {
  _mm256_maskstore_epi32(p, lanes8(m & 0xff), x.a);
  _mm256_maskstore_epi32(p + 8, lanes8(m >> 8), x.b);
}
inline vi iset(int32_t x) { const __m256i v = _mm256_set1_epi32(x); return {v, v}; }
inline vi iota() { return {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)}; }
inline vi operator+(vi x, vi y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
inline vi operator-(vi x, vi y) { return {_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)}; }
inline vi select(m16 m, vi x, vi y) {
  return {_mm256_blendv_epi8(x.a, y.a, lanes8(m & 0xff)), _mm256_blendv_epi8(x.b, y.b, lanes8(m >> 8))};
}
inline int32_t reduce_min(m16 m, vi x) {
  alignas(32) int32_t t[16];
  vstore_i(t, x);
  int32_t r = INT32_MAX;
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1 && t[i] < r) r = t[i];
  return r;
}
inline vf to_float(vi x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
inline vi to_int_trunc(vf x) { return {_mm256_cvttps_epi32(x.a), _mm256_cvttps_epi32(x.b)}; }
inline void store_bytes(void* p, vi x, m16 m) {
  alignas(32) int32_t t[16];
  vstore_i(t, x);
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) ((uint8_t*)p)[i] = (uint8_t)t[i];
}

inline void prefetch_l2(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_T1); }

// ================================================================================================================
#else  // BJ_ISA_GENERIC: every op lane by lane, in the order (and with the NaN rules) of the AVX-512 instruction

struct vf { float x[16]; };
struct vi { int32_t x[16]; };

#define BJ_LANES for (int i = 0; i < 16; ++i)
inline vf vzero() { vf r; BJ_LANES r.x[i] = 0.0f; return r; }
inline vf vset(float v) { vf r; BJ_LANES r.x[i] = v; return r; }
inline vf vload(const float* p) { vf r; memcpy(r.x, p, sizeof r.x); return r; }
inline vf vload(const float* p, m16 m) { vf r; BJ_LANES r.x[i] = m >> i & 1 ? p[i] : 0.0f; return r; }
inline void vstore(float* p, vf v) { memcpy(p, v.x, sizeof v.x); }
inline void vstore(float* p, vf v, m16 m) { BJ_LANES if (m >> i & 1) p[i] = v.x[i]; }
inline vf operator+(vf a, vf b) { BJ_LANES a.x[i] = a.x[i] + b.x[i]; return a; }
inline vf operator-(vf a, vf b) { BJ_LANES a.x[i] = a.x[i] - b.x[i]; return a; }
inline vf operator*(vf a, vf b) { BJ_LANES a.x[i] = a.x[i] * b.x[i]; return a; }
inline vf operator/(vf a, vf b) { BJ_LANES a.x[i] = a.x[i] / b.x[i]; return a; }
inline vf fmadd(vf a, vf b, vf c) { BJ_LANES a.x[i] = __builtin_fmaf(a.x[i], b.x[i], c.x[i]); return a; }
inline vf vmax(vf a, vf b) { BJ_LANES a.x[i] = a.x[i] > b.x[i] ? a.x[i] : b.x[i]; return a; }  // MAXPS: else b
inline vf vmin(vf a, vf b) { BJ_LANES a.x[i] = a.x[i] < b.x[i] ? a.x[i] : b.x[i]; return a; }
inline vf vabs(vf a) { BJ_LANES a.x[i] = u2f(f2u(a.x[i]) & 0x7fffffffu); return a; }
inline vf copysign(vf mag, vf sgn) { BJ_LANES mag.x[i] = u2f(f2u(mag.x[i]) | (f2u(sgn.x[i]) & 0x80000000u)); return mag; }
inline vf round_even(vf a) { BJ_LANES a.x[i] = __builtin_rintf(a.x[i]); return a; }  // the default mode: nearest even
inline vf scale2(vf p, vf e) { BJ_LANES p.x[i] = p.x[i] * u2f((uint32_t)((int32_t)e.x[i] + 127) << 23); return p; }
inline m16 lt(vf a, vf b) { m16 m = 0; BJ_LANES m |= (m16)(a.x[i] < b.x[i]) << i; return m; }
inline m16 gt(vf a, vf b) { m16 m = 0; BJ_LANES m |= (m16)(a.x[i] > b.x[i]) << i; return m; }
inline m16 eq(vf a, vf b) { m16 m = 0; BJ_LANES m |= (m16)(a.x[i] == b.x[i]) << i; return m; }
inline m16 isnan(vf a) { m16 m = 0; BJ_LANES m |= (m16)(a.x[i] != a.x[i]) << i; return m; }
inline vf select(m16 m, vf a, vf b) { BJ_LANES a.x[i] = m >> i & 1 ? b.x[i] : a.x[i]; return a; }
inline vf keep(m16 m, vf a) { BJ_LANES a.x[i] = m >> i & 1 ? a.x[i] : 0.0f; return a; }
inline float max2(float a, float b) { return a > b ? a : b; }
inline float reduce_max(vf v) {  // AVX-512's tree: (i, i+8), (i, i+4), (i, i+2), (i, i+1)
  float a[8], b[4];
  for (int i = 0; i < 8; ++i) a[i] = max2(v.x[i], v.x[i + 8]);
  for (int i = 0; i < 4; ++i) b[i] = max2(a[i], a[i + 4]);
  return max2(max2(b[0], b[2]), max2(b[1], b[3]));
}
inline float hsum(vf v) {
  float a[8], b[4];
  for (int i = 0; i < 8; ++i) a[i] = v.x[i] + v.x[i + 8];
  for (int i = 0; i < 4; ++i) b[i] = a[i] + a[i + 4];
  return (b[0] + b[2]) + (b[1] + b[3]);
}
inline vf vload_bf16(const uint16_t* p) { vf r; BJ_LANES r.x[i] = bf16_value(p[i]); return r; }
inline vf vload_bf16(const uint16_t* p, m16 m) { vf r; BJ_LANES r.x[i] = m >> i & 1 ? bf16_value(p[i]) : 0.0f; return r; }
inline void vstore_bf16(uint16_t* p, vf v) { BJ_LANES p[i] = bf16_bits(v.x[i]); }
inline vf round_bf16(vf v) { BJ_LANES v.x[i] = bf16_value(bf16_bits(v.x[i])); return v; }
inline void vstore_bf16(uint16_t* p, vf v, m16 m) { BJ_LANES if (m >> i & 1) p[i] = bf16_bits(v.x[i]); }
inline vf dot_bf16_pairs(vf acc, const uint32_t* pairs, uint32_t b) {
  const float be = u2f(b << 16), bo = u2f(b & 0xffff0000u);
  BJ_LANES acc.x[i] = __builtin_fmaf(u2f(pairs[i] << 16), be, acc.x[i]);
  BJ_LANES acc.x[i] = __builtin_fmaf(u2f(pairs[i] & 0xffff0000u), bo, acc.x[i]);
  return acc;
}
inline vi vload_i(const int32_t* p) { vi r; memcpy(r.x, p, sizeof r.x); return r; }
inline vi vload_i(const int32_t* p, m16 m) { vi r; BJ_LANES r.x[i] = m >> i & 1 ? p[i] : 0; return r; }
inline void vstore_i(int32_t* p, vi v) { memcpy(p, v.x, sizeof v.x); }
inline void vstore_i(int32_t* p, vi v, m16 m) { BJ_LANES if (m >> i & 1) p[i] = v.x[i]; }
inline vi iset(int32_t v) { vi r; BJ_LANES r.x[i] = v; return r; }
inline vi iota() { vi r; BJ_LANES r.x[i] = i; return r; }
inline vi operator+(vi a, vi b) { BJ_LANES a.x[i] = (int32_t)((uint32_t)a.x[i] + (uint32_t)b.x[i]); return a; }
inline vi operator-(vi a, vi b) { BJ_LANES a.x[i] = (int32_t)((uint32_t)a.x[i] - (uint32_t)b.x[i]); return a; }
inline vi select(m16 m, vi a, vi b) { BJ_LANES a.x[i] = m >> i & 1 ? b.x[i] : a.x[i]; return a; }
inline int32_t reduce_min(m16 m, vi a) {
  int32_t r = INT32_MAX;
  BJ_LANES if (m >> i & 1 && a.x[i] < r) r = a.x[i];
  return r;
}
inline vf to_float(vi a) { vf r; BJ_LANES r.x[i] = (float)a.x[i]; return r; }  // nearest even
inline vi to_int_trunc(vf a) { vi r; BJ_LANES r.x[i] = (int32_t)a.x[i]; return r; }
inline void store_bytes(void* p, vi v, m16 m) { BJ_LANES if (m >> i & 1) ((uint8_t*)p)[i] = (uint8_t)v.x[i]; }
#undef BJ_LANES

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

#endif

// ---- on every path -----------------------------------------------------------------------------------------

// 16 values of a row as fp32, from fp32 or bf16 storage (T = uint16_t: bf16 bits)
inline vf vload(const uint16_t* p) { return vload_bf16(p); }
inline vf vload(const uint16_t* p, m16 m) { return vload_bf16(p, m); }
inline void vstore(uint16_t* p, vf x) { vstore_bf16(p, x); }
inline void vstore(uint16_t* p, vf x, m16 m) { vstore_bf16(p, x, m); }

// x rounded to the storage type and widened back (the value torch keeps for a result of that dtype)
inline vf round_to(vf x, const float*) { return x; }
inline vf round_to(vf x, const uint16_t*) { return round_bf16(x); }

inline void prefetch_l2(const void* p, int bytes) {
  for (int b = 0; b < bytes; b += 64) prefetch_l2((const char*)p + b);
}

}  // namespace
