// Integer and byte vectors beside vec.h's `vf`/`vi`, for the int8/int4 KV-cache kernels (kv_quant_store.cpp,
// paged_attention_quant.cpp): `vb` (64 bytes: 16 dwords of 4 u8 or s8 each) and `vw` (32 int16: 16 dwords of an
// int16 pair each), on the same three paths (BJ_ISA_AVX512, BJ_ISA_AVX2, BJ_ISA_GENERIC; kernels/native/build.py).
//
// Every op states the AVX-512 instruction whose result it reproduces, and reproduces it exactly: the integer dot
// products are exact in int32 (wrapping as the instructions do), so the kernels' integer results are bitwise the
// same on every path (tests/kernels/test_native_kv_quant.py compares the paths). Where the hardware lacks the VNNI
// instruction it is emulated without saturation:
//   dpbusd (u8 x s8 quads -> int32): AVX512-VNNI `vpdpbusd`, AVX-VNNI `vpdpbusd` (VEX) where the compiler targets
//     them; elsewhere the bytes are widened to int16 (u8: even bytes masked, odd bytes shifted down; s8: even bytes
//     shifted up then arithmetic-shifted down, odd arithmetic-shifted down) and two `vpmaddwd` add the even and
//     the odd products: each |u8 x s8| <= 32640, a pair's sum fits int16 x int16 -> int32 exactly. (`vpmaddubsw`
//     is not used: it saturates a pair's sum to int16, which 255 x 127 x 2 exceeds.)
//   dpwssd (int16 pairs -> int32): AVX512-VNNI `vpdpwssd`, AVX-VNNI `vpdpwssd` (VEX); elsewhere `vpmaddwd` + `vpaddd`,
//     the same bits (vpmaddwd's one wrapping case, -32768 x -32768 twice, wraps to what vpdpwssd's sum wraps to).
// Lane and byte order: dword i holds bytes 4i..4i+3 (int16 2i, 2i+1), as in memory, on every path (AVX2: dwords
// 0-7 in the first ymm). kernels/native/build.py hashes this header into every kernel's cache key.
#pragma once

#include "vec.h"

namespace {

// ================================================================================================================
#if defined(BJ_ISA_AVX512)

struct vb { __m512i v; };
struct vw { __m512i v; };

inline vb bload(const void* p) { return {_mm512_loadu_si512(p)}; }
inline void bstore(void* p, vb x) { _mm512_storeu_si512(p, x.v); }
inline vb bset(uint32_t quad) { return {_mm512_set1_epi32((int)quad)}; }  // vpbroadcastd: 4 bytes in every dword
// each byte's low / high nibble as a byte 0..15 (vpandq; vpsrlw 4 + vpandq)
inline vb low_nibbles(vb x) { return {_mm512_and_si512(x.v, _mm512_set1_epi8(0x0F))}; }
inline vb high_nibbles(vb x) { return {_mm512_and_si512(_mm512_srli_epi16(x.v, 4), _mm512_set1_epi8(0x0F))}; }
inline vb add_bytes(vb x, uint8_t c) { return {_mm512_add_epi8(x.v, _mm512_set1_epi8((char)c))}; }  // vpaddb, wraps
// acc + the sum of the 4 products u8 x s8 of each dword (vpdpbusd: exact, wrapping in int32)
inline vi dpbusd(vi acc, vb u, vb s) {
#if defined(__AVX512VNNI__)
  return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)};
#else
  const __m512i ue = _mm512_and_si512(u.v, _mm512_set1_epi16(0x00ff)), uo = _mm512_srli_epi16(u.v, 8);
  const __m512i se = _mm512_srai_epi16(_mm512_slli_epi16(s.v, 8), 8), so = _mm512_srai_epi16(s.v, 8);
  return {_mm512_add_epi32(acc.v, _mm512_add_epi32(_mm512_madd_epi16(ue, se), _mm512_madd_epi16(uo, so)))};
#endif
}

inline vw wload(const int16_t* p) { return {_mm512_loadu_si512(p)}; }
inline void wstore(int16_t* p, vw x) { _mm512_storeu_si512(p, x.v); }
inline vw wset(uint32_t pair) { return {_mm512_set1_epi32((int)pair)}; }  // vpbroadcastd: one int16 pair everywhere
inline vw widen_s8(const int8_t* p) { return {_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p))}; }  // vpmovsxbw
// the 32 nibbles at `shift` (0: low, 4: high) of 32 bytes, as int16 minus 8 (int4 codes stored + 8): vpsrlw, vpand,
// vpmovzxbw, vpsubw
inline vw widen_nibbles(const uint8_t* p, int shift) {
  __m256i x = _mm256_loadu_si256((const __m256i*)p);
  if (shift) x = _mm256_srli_epi16(x, 4);
  return {_mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(x, _mm256_set1_epi8(0x0F))), _mm512_set1_epi16(8))};
}
// acc + a.even x b.even + a.odd x b.odd per dword (vpdpwssd: exact, wrapping in int32)
inline vi dpwssd(vi acc, vw a, vw b) {
#if defined(__AVX512VNNI__)
  return {_mm512_dpwssd_epi32(acc.v, a.v, b.v)};
#else
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(a.v, b.v))};
#endif
}

inline vi operator*(vi a, vi b) { return {_mm512_mullo_epi32(a.v, b.v)}; }  // vpmulld: the low 32 bits
inline int32_t reduce_add(vi a) { return _mm512_reduce_add_epi32(a.v); }    // wrapping (any order: the same)
// 16 lanes to int8, saturated (vpmovsdb)
inline void store_i8(int8_t* p, vi x) { _mm_storeu_si128((__m128i*)p, _mm512_cvtsepi32_epi8(x.v)); }
// 16 lanes to int16, values in [-32768, 32767] (vpmovdw; outside the range the paths differ)
inline void store_i16(int16_t* p, vi x) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(x.v)); }
// 16 fp16 values widened (vcvtph2ps, exact)
inline vf vload_fp16(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }

// ================================================================================================================
#elif defined(BJ_ISA_AVX2)

struct vb { __m256i a, b; };
struct vw { __m256i a, b; };

inline vb bload(const void* p) {
  return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)((const char*)p + 32))};
}
inline void bstore(void* p, vb x) {
  _mm256_storeu_si256((__m256i*)p, x.a);
  _mm256_storeu_si256((__m256i*)((char*)p + 32), x.b);
}
inline vb bset(uint32_t quad) { const __m256i v = _mm256_set1_epi32((int)quad); return {v, v}; }
inline vb low_nibbles(vb x) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(x.a, m), _mm256_and_si256(x.b, m)};
}
inline vb high_nibbles(vb x) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(x.a, 4), m), _mm256_and_si256(_mm256_srli_epi16(x.b, 4), m)};
}
inline vb add_bytes(vb x, uint8_t c) {
  const __m256i v = _mm256_set1_epi8((char)c);
  return {_mm256_add_epi8(x.a, v), _mm256_add_epi8(x.b, v)};
}
inline __m256i dpbusd8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  const __m256i ue = _mm256_and_si256(u, _mm256_set1_epi16(0x00ff)), uo = _mm256_srli_epi16(u, 8);
  const __m256i se = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), so = _mm256_srai_epi16(s, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ue, se), _mm256_madd_epi16(uo, so)));
#endif
}
inline vi dpbusd(vi acc, vb u, vb s) { return {dpbusd8(acc.a, u.a, s.a), dpbusd8(acc.b, u.b, s.b)}; }

inline vw wload(const int16_t* p) { return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 16))}; }
inline void wstore(int16_t* p, vw x) {
  _mm256_storeu_si256((__m256i*)p, x.a);
  _mm256_storeu_si256((__m256i*)(p + 16), x.b);
}
inline vw wset(uint32_t pair) { const __m256i v = _mm256_set1_epi32((int)pair); return {v, v}; }
inline vw widen_s8(const int8_t* p) {
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 16)))};
}
inline __m256i widen_nibbles16(const uint8_t* p, int shift) {
  __m128i x = _mm_loadu_si128((const __m128i*)p);
  if (shift) x = _mm_srli_epi16(x, 4);
  return _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(x, _mm_set1_epi8(0x0F))), _mm256_set1_epi16(8));
}
inline vw widen_nibbles(const uint8_t* p, int shift) { return {widen_nibbles16(p, shift), widen_nibbles16(p + 16, shift)}; }
inline __m256i dpwssd8(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
inline vi dpwssd(vi acc, vw a, vw b) { return {dpwssd8(acc.a, a.a, b.a), dpwssd8(acc.b, a.b, b.b)}; }

inline vi operator*(vi x, vi y) { return {_mm256_mullo_epi32(x.a, y.a), _mm256_mullo_epi32(x.b, y.b)}; }
inline int32_t reduce_add(vi x) {
  __m256i a = _mm256_add_epi32(x.a, x.b);
  __m128i b = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  b = _mm_add_epi32(b, _mm_shuffle_epi32(b, 0x4e));
  b = _mm_add_epi32(b, _mm_shuffle_epi32(b, 0xb1));
  return _mm_cvtsi128_si32(b);
}
inline __m256i packs16(vi x) {  // 16 lanes to int16 saturated, in order (vpackssdw leaves a0-3 b0-3 | a4-7 b4-7)
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(x.a, x.b), 0xd8);
}
inline void store_i8(int8_t* p, vi x) {
  const __m256i w = packs16(x);
  _mm_storeu_si128((__m128i*)p, _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}
inline void store_i16(int16_t* p, vi x) { _mm256_storeu_si256((__m256i*)p, packs16(x)); }
inline vf vload_fp16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
}

// ================================================================================================================
#else  // BJ_ISA_GENERIC: lane by lane, in plain integer arithmetic (wrapping through uint32_t, as the instructions)

struct vb { uint8_t x[64]; };
struct vw { int16_t x[32]; };

#define BJ_LANES for (int i = 0; i < 16; ++i)
inline vb bload(const void* p) { vb r; memcpy(r.x, p, sizeof r.x); return r; }
inline void bstore(void* p, vb v) { memcpy(p, v.x, sizeof v.x); }
inline vb bset(uint32_t quad) { vb r; BJ_LANES memcpy(r.x + 4 * i, &quad, 4); return r; }
inline vb low_nibbles(vb v) { for (int i = 0; i < 64; ++i) v.x[i] &= 0x0F; return v; }
inline vb high_nibbles(vb v) { for (int i = 0; i < 64; ++i) v.x[i] = (uint8_t)(v.x[i] >> 4); return v; }
inline vb add_bytes(vb v, uint8_t c) { for (int i = 0; i < 64; ++i) v.x[i] = (uint8_t)(v.x[i] + c); return v; }
inline vi dpbusd(vi acc, vb u, vb s) {
  BJ_LANES {
    int32_t d = 0;  // |d| <= 4 x 255 x 128
    for (int k = 0; k < 4; ++k) d += (int32_t)u.x[4 * i + k] * (int32_t)(int8_t)s.x[4 * i + k];
    acc.x[i] = (int32_t)((uint32_t)acc.x[i] + (uint32_t)d);
  }
  return acc;
}

inline vw wload(const int16_t* p) { vw r; memcpy(r.x, p, sizeof r.x); return r; }
inline void wstore(int16_t* p, vw v) { memcpy(p, v.x, sizeof v.x); }
inline vw wset(uint32_t pair) { vw r; BJ_LANES memcpy(r.x + 2 * i, &pair, 4); return r; }
inline vw widen_s8(const int8_t* p) { vw r; for (int i = 0; i < 32; ++i) r.x[i] = p[i]; return r; }
inline vw widen_nibbles(const uint8_t* p, int shift) {
  vw r;
  for (int i = 0; i < 32; ++i) r.x[i] = (int16_t)(((p[i] >> shift) & 0x0F) - 8);
  return r;
}
inline vi dpwssd(vi acc, vw a, vw b) {
  BJ_LANES {  // each product fits int32; their sum may not (-32768^2 x 2): added as uint32
    const uint32_t e = (uint32_t)((int32_t)a.x[2 * i] * b.x[2 * i]), o = (uint32_t)((int32_t)a.x[2 * i + 1] * b.x[2 * i + 1]);
    acc.x[i] = (int32_t)((uint32_t)acc.x[i] + e + o);
  }
  return acc;
}

inline vi operator*(vi a, vi b) { BJ_LANES a.x[i] = (int32_t)((uint32_t)a.x[i] * (uint32_t)b.x[i]); return a; }
inline int32_t reduce_add(vi a) {
  uint32_t s = 0;
  BJ_LANES s += (uint32_t)a.x[i];
  return (int32_t)s;
}
inline void store_i8(int8_t* p, vi v) { BJ_LANES p[i] = (int8_t)(v.x[i] < -128 ? -128 : v.x[i] > 127 ? 127 : v.x[i]); }
inline void store_i16(int16_t* p, vi v) { BJ_LANES p[i] = (int16_t)v.x[i]; }
inline vf vload_fp16(const uint16_t* p) { vf r; BJ_LANES r.x[i] = fp32(p[i]); return r; }
#undef BJ_LANES

#endif

}  // namespace
