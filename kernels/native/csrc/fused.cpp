// Fused elementwise ops of a Llama layer on the CPU (vec.h: AVX-512, AVX2 or generic): residual add + RMSNorm, rotary embedding
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

#include <math.h>
#include <omp.h>
#include <stdint.h>

namespace {

// 16 values of T (float, or bf16 bits as uint16_t) as fp32; stored back from values already rounded to T
template <typename T>
struct IO {
  static vf load(const T* p, m16 m) { return vload(p, m); }
  static void store(T* p, vf x, m16 m) { vstore(p, x, m); }
  static vf round(vf x) { return round_to(x, (const T*)nullptr); }
};

// residual (if given) += x, then out = weight * (residual / rms(residual)), per row of n values.
template <typename T>
void add_rms_norm(const T* x, T* residual, const T* weight, T* out, int rows, int n, int64_t x_stride, float eps,
                  int threads) {
  using io = IO<T>;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 16)
  for (int r = 0; r < rows; ++r) {
    T* h = residual + (int64_t)r * n;
    const T* xr = x ? x + r * x_stride : nullptr;
    vf ss = vzero();
    for (int i = 0; i < n; i += 16) {
      const m16 m = tail(n, i);
      vf v = io::load(h + i, m);
      if (xr) {
        v = io::round(v + io::load(xr + i, m));
        io::store(h + i, v, m);
      }
      ss = fmadd(v, v, ss);
    }
    const float inv = 1.0f / sqrtf(hsum(ss) / (float)n + eps);
    const vf s = vset(inv);
    T* o = out + (int64_t)r * n;
    for (int i = 0; i < n; i += 16) {
      const m16 m = tail(n, i);
      const vf normed = io::round(io::load(h + i, m) * s);
      io::store(o + i, io::round(io::load(weight + i, m) * normed), m);
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
        const m16 m = tail(half, i);
        const vf x1 = io::load(v + i, m), x2 = io::load(v + half + i, m);
        const vf c1 = io::load(c + i, m), s1 = io::load(s + i, m);
        const vf c2 = io::load(c + half + i, m), s2 = io::load(s + half + i, m);
        const vf n2 = vzero() - x2;  // rotate_half's -x2
        const vf y1 = io::round(io::round(x1 * c1) + io::round(n2 * s1));
        const vf y2 = io::round(io::round(x2 * c2) + io::round(x1 * s2));
        io::store(v + i, y1, m);
        io::store(v + half + i, y2, m);
      }
    }
  }
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
      const m16 m = tail(n, i);
      const vf x = io::load(g + i, m);
      const vf e = exp_ps(vzero() - x);
      const vf silu = io::round(x / (vset(1.0f) + e));
      io::store(o + i, io::round(silu * io::load(u + i, m)), m);
    }
  }
}

// gate_up [tokens, 2n] (gate | up) -> out [tokens, n] = gelu_tanh(gate) * up, with torch's formula
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) in its order, the GELU rounded to T before the product.
template <typename T>
void gelu_tanh_mul(const T* gate_up, T* out, int tokens, int n, int threads) {
  using io = IO<T>;
  const vf beta = vset(0.7978845608028654f), kappa = vset(0.044715f);
  const vf half = vset(0.5f), one = vset(1.0f);
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens >= 8)
  for (int t = 0; t < tokens; ++t) {
    const T* g = gate_up + (int64_t)t * 2 * n;
    const T* u = g + n;
    T* o = out + (int64_t)t * n;
    for (int i = 0; i < n; i += 16) {
      const m16 m = tail(n, i);
      const vf x = io::load(g + i, m);
      const vf cube = (x * x) * x;
      const vf inner = beta * (x + kappa * cube);
      const vf gelu = io::round((half * x) * (one + tanh_ps(inner)));
      io::store(o + i, io::round(gelu * io::load(u + i, m)), m);
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
  const vf c = vset(cap);
#pragma omp parallel for schedule(static) num_threads(threads) if (chunks >= 4)
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t end = (k + 1) * CHUNK < n ? (k + 1) * CHUNK : n;
    for (int64_t i = k * CHUNK; i < end; i += 16) {
      const m16 m = tail((int)(end - i), 0);
      const vf y = io::round(tanh_ps(io::round(io::load(x + i, m) / c)));
      io::store(out + i, io::round(y * c), m);
    }
  }
}

// The first index of the largest value in x[0, n) (the first NaN, when there is one).
template <typename T>
int64_t argmax_row(const T* x, int n) {
  using io = IO<T>;
  auto one = [&](int i) {  // x[i] as fp32
    alignas(64) float t[16];
    vstore(t, io::load(x + i, 1));
    return t[0];
  };
  if (n < 16) {
    int64_t best = 0;
    for (int i = 0; i < n; ++i) {
      const float v = one(i), b = one((int)best);
      if (v != v) return i;
      if (v > b) best = i;
    }
    return best;
  }
  vf best = io::load(x, ALL);
  vi where = iota();
  vi idx = where;
  const vi step = iset(16);
  int64_t nan = -1;
  m16 nans = isnan(best);
  if (nans) return __builtin_ctz(nans);
  int i = 16;
  for (; i + 16 <= n; i += 16) {
    idx = idx + step;
    const vf v = io::load(x + i, ALL);
    nans = isnan(v);
    if (nans) {
      nan = i + __builtin_ctz(nans);
      break;
    }
    const m16 g = gt(v, best);  // strictly: a lane keeps its first maximum
    best = select(g, best, v);
    where = select(g, where, idx);
  }
  if (nan >= 0) return nan;
  const float m = reduce_max(best);
  const m16 at = eq(best, vset(m));
  int64_t first = reduce_min(at, where);
  float top = m;
  for (; i < n; ++i) {  // the tail: later indices win only when strictly larger
    const float v = one(i);
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
