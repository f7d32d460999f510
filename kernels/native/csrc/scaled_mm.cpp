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
