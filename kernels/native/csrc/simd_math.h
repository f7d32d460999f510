// Vector math shared by the CPU kernels (paged_attention*.cpp through attention_common.h, fused.cpp):
// exp2, tanh and a fixed-order horizontal sum. kernels/native/build.py hashes this header into every kernel's
// cache key. Every function is lane-wise: a lane's result does not depend on the others.
#pragma once

#include <immintrin.h>

namespace {

// exp2 for x <= 127, to ~1 ulp: 2^round(x) * e^(f ln2), f in [-0.5, 0.5], Taylor to degree 7; below -126
// it gives 2^-126 (attention masks those lanes to 0).
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
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

// tanh to 1.32 ulp at most (mean 0.16; measured over every fp32 of magnitude 1e-6 to 40 against double tanh),
// odd, NaN kept: |x| < 1: x + x^3 P(x^2), P minimax for the relative error (degree 6); |x| >= 1:
// 1 - 2 / (1 + e^(2|x|)), with |x| clamped to 10 (fp32 tanh is 1 from 9.011 on) so e^(2|x|) cannot overflow.
inline __m512 tanh_ps(__m512 x) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512 ax = _mm512_andnot_ps(sign, x);
  const __m512 u = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(-3.584505757316947e-04f);
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(2.3013600148260593e-03f));
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(-7.946101017296314e-03f));
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(2.148665487766266e-02f));
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(-5.387980118393898e-02f));
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(1.3332344591617584e-01f));
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(-3.3333295583724976e-01f));
  const __m512 small = _mm512_fmadd_ps(ax, _mm512_mul_ps(u, p), ax);
  const __m512 e2x = exp2_ps(_mm512_mul_ps(_mm512_min_ps(ax, _mm512_set1_ps(10.0f)), _mm512_set1_ps(2.8853900817779268f)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 large = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(one, e2x)));
  const __m512 t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, one, _CMP_LT_OQ), large, small);
  const __m512 r = _mm512_or_ps(t, _mm512_and_ps(x, sign));
  return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

// Sum of 16 lanes in a fixed tree (the order is part of the result).
inline float hsum(__m512 v) {
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}

}  // namespace
