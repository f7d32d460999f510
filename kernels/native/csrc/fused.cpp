// Fused elementwise ops of a Llama layer on the CPU (AVX-512): residual add + RMSNorm, rotary embedding
// in place on q and k, SiLU(gate) * up, GELU-tanh(gate) * up (Gemma). Each replaces a chain of small torch
// ops (one pass over the data instead of 5-8, no temporaries). Also Gemma 2's final logit soft-cap,
// tanh(x / cap) * cap.
//
// Also the greedy argmax of logit rows (exactly torch.argmax: the first index of the maximum, a NaN
// counting as the maximum), on bf16 logits as they come out of the LM head: widening them to fp32 first
// cost more than the argmax itself.
//
// Must equal: kernels/reference/norm.py (rms_norm; HF's order: fp32 statistics, cast, then the weight),
// kernels/reference/rotary.py (apply_rotary: bitwise, the same products and sums rounded to the dtype after
// each op, as torch does), kernels/reference/elementwise.py: silu_mul (to a few ulps: another exp),
// gelu_tanh_mul and softcap (torch's formulas, in its order and with its roundings to the dtype; to a few
// ulps: another tanh, simd_math.h's). Tested by tests/kernels/test_native_kernels.py (fp32 and bf16 against
// the references, the ranges' ends, NaN and infinities).
// Every row is computed alone, in a fixed order: results do not depend on the batch or thread count.

#include "simd_math.h"

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

namespace {

// Rounds fp32 lanes to bf16 (nearest even) and widens back: the value torch stores for a bf16 result.
inline __m512 round_bf16(__m512 x) {
#ifdef __AVX512BF16__
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
#else
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m256i b = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16));
#endif
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

template <typename T>
struct IO;

template <>
struct IO<float> {
  static __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store(float* p, __m512 x, __mmask16 m) { _mm512_mask_storeu_ps(p, m, x); }
  static __m512 round(__m512 x) { return x; }
};

template <>
struct IO<uint16_t> {  // bf16
  static __m512 load(const uint16_t* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
  }
  static void store(uint16_t* p, __m512 x, __mmask16 m) {
    // x holds bf16 values already (rounded): keep the high halves
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
  }
  static __m512 round(__m512 x) { return round_bf16(x); }
};

inline __mmask16 tail(int n, int i) { return n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u); }

// residual (if given) += x, then out = weight * (residual / rms(residual)), per row of n values.
template <typename T>
void add_rms_norm(const T* x, T* residual, const T* weight, T* out, int rows, int n, int64_t x_stride, float eps,
                  int threads) {
  using io = IO<T>;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 16)
  for (int r = 0; r < rows; ++r) {
    T* h = residual + (int64_t)r * n;
    const T* xr = x ? x + r * x_stride : nullptr;
    __m512 ss = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
      const __mmask16 m = tail(n, i);
      __m512 v = io::load(h + i, m);
      if (xr) {
        v = io::round(_mm512_add_ps(v, io::load(xr + i, m)));
        io::store(h + i, v, m);
      }
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float inv = 1.0f / sqrtf(hsum(ss) / (float)n + eps);
    const __m512 s = _mm512_set1_ps(inv);
    T* o = out + (int64_t)r * n;
    for (int i = 0; i < n; i += 16) {
      const __mmask16 m = tail(n, i);
      const __m512 normed = io::round(_mm512_mul_ps(io::load(h + i, m), s));
      io::store(o + i, io::round(_mm512_mul_ps(io::load(weight + i, m), normed)), m);
    }
  }
}

// x [tokens, heads, D] (token stride given, heads dense) rotated in place by the cos/sin rows of each
// token's position ("rotate half" layout): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, each product
// and sum rounded to T as torch's q * cos + rotate_half(q) * sin is.
template <typename T>
void rotary(T* x, int64_t stride, int tokens, int heads, int d, const T* cos, const T* sin, const int64_t* positions,
            int threads) {
  using io = IO<T>;
  const int half = d / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens >= 16)
  for (int t = 0; t < tokens; ++t) {
    const T* c = cos + positions[t] * d;
    const T* s = sin + positions[t] * d;
    for (int h = 0; h < heads; ++h) {
      T* v = x + t * stride + (int64_t)h * d;
      for (int i = 0; i < half; i += 16) {
        const __mmask16 m = tail(half, i);
        const __m512 x1 = io::load(v + i, m), x2 = io::load(v + half + i, m);
        const __m512 c1 = io::load(c + i, m), s1 = io::load(s + i, m);
        const __m512 c2 = io::load(c + half + i, m), s2 = io::load(s + half + i, m);
        const __m512 n2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);  // rotate_half's -x2
        const __m512 y1 = io::round(_mm512_add_ps(io::round(_mm512_mul_ps(x1, c1)), io::round(_mm512_mul_ps(n2, s1))));
        const __m512 y2 = io::round(_mm512_add_ps(io::round(_mm512_mul_ps(x2, c2)), io::round(_mm512_mul_ps(x1, s2))));
        io::store(v + i, y1, m);
        io::store(v + half + i, y2, m);
      }
    }
  }
}

// e^x for any x, ~1 ulp: exp2 of x log2 e, clamped to [-126, 127].
inline __m512 exp_ps(__m512 x) {
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  return exp2_ps(_mm512_min_ps(y, _mm512_set1_ps(127.0f)));
}

// gate_up [tokens, 2n] (gate | up) -> out [tokens, n] = silu(gate) * up, silu rounded to T first as
// F.silu(gate) * up does.
template <typename T>
void silu_mul(const T* gate_up, T* out, int tokens, int n, int threads) {
  using io = IO<T>;
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens >= 8)
  for (int t = 0; t < tokens; ++t) {
    const T* g = gate_up + (int64_t)t * 2 * n;
    const T* u = g + n;
    T* o = out + (int64_t)t * n;
    for (int i = 0; i < n; i += 16) {
      const __mmask16 m = tail(n, i);
      const __m512 x = io::load(g + i, m);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x));
      const __m512 silu = io::round(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
      io::store(o + i, io::round(_mm512_mul_ps(silu, io::load(u + i, m))), m);
    }
  }
}

// gate_up [tokens, 2n] (gate | up) -> out [tokens, n] = gelu_tanh(gate) * up, with torch's formula
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) in its order, the GELU rounded to T before the product.
template <typename T>
void gelu_tanh_mul(const T* gate_up, T* out, int tokens, int n, int threads) {
  using io = IO<T>;
  const __m512 beta = _mm512_set1_ps(0.7978845608028654f), kappa = _mm512_set1_ps(0.044715f);
  const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens >= 8)
  for (int t = 0; t < tokens; ++t) {
    const T* g = gate_up + (int64_t)t * 2 * n;
    const T* u = g + n;
    T* o = out + (int64_t)t * n;
    for (int i = 0; i < n; i += 16) {
      const __mmask16 m = tail(n, i);
      const __m512 x = io::load(g + i, m);
      const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
      const __m512 inner = _mm512_mul_ps(beta, _mm512_add_ps(x, _mm512_mul_ps(kappa, cube)));
      const __m512 gelu = io::round(_mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, tanh_ps(inner))));
      io::store(o + i, io::round(_mm512_mul_ps(gelu, io::load(u + i, m))), m);
    }
  }
}

// out = tanh(x / cap) * cap over n values, each op rounded to T as torch's tanh(x / cap) * cap is. Split in
// fixed chunks, not rows: a few rows of a large vocabulary still use every thread.
template <typename T>
void softcap(const T* x, T* out, int64_t n, float cap, int threads) {
  using io = IO<T>;
  constexpr int64_t CHUNK = 1 << 14;
  const int64_t chunks = (n + CHUNK - 1) / CHUNK;
  const __m512 c = _mm512_set1_ps(cap);
#pragma omp parallel for schedule(static) num_threads(threads) if (chunks >= 4)
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t end = (k + 1) * CHUNK < n ? (k + 1) * CHUNK : n;
    for (int64_t i = k * CHUNK; i < end; i += 16) {
      const __mmask16 m = end - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (end - i)) - 1u);
      const __m512 y = io::round(tanh_ps(io::round(_mm512_div_ps(io::load(x + i, m), c))));
      io::store(out + i, io::round(_mm512_mul_ps(y, c)), m);
    }
  }
}

// The first index of the largest value in x[0, n) (the first NaN, when there is one).
template <typename T>
int64_t argmax_row(const T* x, int n) {
  using io = IO<T>;
  if (n < 16) {
    int64_t best = 0;
    for (int i = 0; i < n; ++i) {
      const float v = _mm512_cvtss_f32(io::load(x + i, 1)), b = _mm512_cvtss_f32(io::load(x + best, 1));
      if (v != v) return i;
      if (v > b) best = i;
    }
    return best;
  }
  __m512 best = io::load(x, 0xffff);
  __m512i where = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i idx = where;
  const __m512i step = _mm512_set1_epi32(16);
  int64_t nan = -1;
  __mmask16 nans = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  if (nans) return __builtin_ctz(nans);
  int i = 16;
  for (; i + 16 <= n; i += 16) {
    idx = _mm512_add_epi32(idx, step);
    const __m512 v = io::load(x + i, 0xffff);
    nans = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (nans) {
      nan = i + __builtin_ctz(nans);
      break;
    }
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly: a lane keeps its first maximum
    best = _mm512_mask_mov_ps(best, gt, v);
    where = _mm512_mask_mov_epi32(where, gt, idx);
  }
  if (nan >= 0) return nan;
  const float m = _mm512_reduce_max_ps(best);
  const __mmask16 at = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
  int64_t first = _mm512_mask_reduce_min_epi32(at, where);
  float top = m;
  for (; i < n; ++i) {  // the tail: later indices win only when strictly larger
    const float v = _mm512_cvtss_f32(io::load(x + i, 1));
    if (v != v) return i;
    if (v > top) {
      top = v;
      first = i;
    }
  }
  return first;
}

template <typename T>
void argmax_rows(const T* x, int rows, int n, int64_t* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 4)
  for (int r = 0; r < rows; ++r) out[r] = argmax_row(x + (int64_t)r * n, n);
}

}  // namespace

extern "C" {

int bj_argmax_rows(const void* x, int rows, int n, int64_t* out, int dtype, int threads) {
  if (dtype == 0)
    argmax_rows<float>((const float*)x, rows, n, out, threads);
  else if (dtype == 1)
    argmax_rows<uint16_t>((const uint16_t*)x, rows, n, out, threads);
  else
    return -1;
  return 0;
}

// dtype: 0 = fp32, 1 = bf16. Returns 0, or -1 for an unsupported dtype.
int bj_add_rms_norm(const void* x, int64_t x_stride, void* residual, const void* weight, void* out, int rows, int n,
                    float eps, int dtype, int threads) {
  if (dtype == 0)
    add_rms_norm<float>((const float*)x, (float*)residual, (const float*)weight, (float*)out, rows, n, x_stride, eps, threads);
  else if (dtype == 1)
    add_rms_norm<uint16_t>((const uint16_t*)x, (uint16_t*)residual, (const uint16_t*)weight, (uint16_t*)out, rows, n,
                           x_stride, eps, threads);
  else
    return -1;
  return 0;
}

int bj_rotary(void* x, int64_t stride, int tokens, int heads, int d, const void* cos, const void* sin,
              const int64_t* positions, int dtype, int threads) {
  if (d % 2) return -2;
  if (dtype == 0)
    rotary<float>((float*)x, stride, tokens, heads, d, (const float*)cos, (const float*)sin, positions, threads);
  else if (dtype == 1)
    rotary<uint16_t>((uint16_t*)x, stride, tokens, heads, d, (const uint16_t*)cos, (const uint16_t*)sin, positions, threads);
  else
    return -1;
  return 0;
}

int bj_silu_mul(const void* gate_up, void* out, int tokens, int n, int dtype, int threads) {
  if (dtype == 0)
    silu_mul<float>((const float*)gate_up, (float*)out, tokens, n, threads);
  else if (dtype == 1)
    silu_mul<uint16_t>((const uint16_t*)gate_up, (uint16_t*)out, tokens, n, threads);
  else
    return -1;
  return 0;
}

int bj_gelu_tanh_mul(const void* gate_up, void* out, int tokens, int n, int dtype, int threads) {
  if (dtype == 0)
    gelu_tanh_mul<float>((const float*)gate_up, (float*)out, tokens, n, threads);
  else if (dtype == 1)
    gelu_tanh_mul<uint16_t>((const uint16_t*)gate_up, (uint16_t*)out, tokens, n, threads);
  else
    return -1;
  return 0;
}

// x and out: n values each (they may be the same buffer); cap > 0.
int bj_softcap(const void* x, void* out, int64_t n, float cap, int dtype, int threads) {
  if (!(cap > 0.0f)) return -2;
  if (dtype == 0)
    softcap<float>((const float*)x, (float*)out, n, cap, threads);
  else if (dtype == 1)
    softcap<uint16_t>((const uint16_t*)x, (uint16_t*)out, n, cap, threads);
  else
    return -1;
  return 0;
}

}  // extern "C"
