// The quantizing KV store of the native int8/int4 cache (layouts: kv_quant_layout.h), and its inverse
// for tests. Written over vec.h / vec_int.h: the same codes and scales on every instruction-set path.
//
// Must equal: kernels/reference/kv_quant.py `quantize` / `dequantize`, bitwise (codes, scales, dequantized values).
// Tested by:  tests/kernels/test_native_kv_quant.py (round trips, one token at a time vs all at once, slot -1; on
//             every instruction-set path this CPU runs, bitwise the same on each).
// Compiled per model with -DHEAD_DIM=D -DGQA=G -DGROUP=<int4 values per scale> (kernels/native/ops.py).

#include "kv_quant_layout.h"

namespace {

// One token and KV head, D values of type T (float, or bf16 bits), to codes and fp16 scales per group of
// `gsize` dims, exactly as kernels/reference/kv_quant.py `quantize`: scale = fp16(absmax / levels), code =
// round-half-even(x / scale) clamped to +-levels (scale 0: codes 0).
template <typename T>
void quantize_vector(const T* x, int gsize, int levels, int8_t* codes, uint16_t* scales) {
  const int per = gsize / 16;
  for (int g = 0; g < D / gsize; ++g) {
    vf v[D / 16];
    vf amax = vzero();
    for (int i = 0; i < per; ++i) {
      v[i] = vload(x + (g * per + i) * 16);
      amax = vmax(amax, vabs(v[i]));
    }
    scales[g] = fp16(reduce_max(amax) / (float)levels);
    const float sf = fp32(scales[g]);
    const vf div = vset(sf > 0 ? sf : 1.0f), hi = vset((float)levels), lo = vset((float)-levels);
    for (int i = 0; i < per; ++i) {  // x / scale (a true division, as torch's), rounded half to even, clamped
      const vf c = vmin(vmax(round_even(v[i] / div), lo), hi);
      store_i8(codes + (g * per + i) * 16, to_int_trunc(c));  // c is integral: truncation is exact
    }
  }
}

template <int BITS, typename T>
void store_kv(const T* k, const T* v, int64_t k_stride, int64_t v_stride, uint8_t* kc, uint8_t* vc, uint16_t* ksc,
              uint16_t* vsc, const int64_t* slots, int tokens, int num_kv_heads, int bs, int num_threads) {
  constexpr int NG = scale_groups<BITS>(), levels = BITS == 8 ? 127 : 7, gsize = D / NG;
  const int64_t code_bytes = (int64_t)bs * D * BITS / 8, scale_elems = (int64_t)bs * NG;
  // parallel over (KV head, K or V): int4 V packs two tokens per byte, so tokens of one head are written
  // by one thread
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads) if (tokens >= 16)
  for (int h = 0; h < num_kv_heads; ++h)
    for (int which = 0; which < 2; ++which)
      for (int t = 0; t < tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;  // a padding token
        const int j = (int)(slot % bs);
        const int64_t b = slot / bs * num_kv_heads + h;
        const T* x = (which ? v + t * v_stride : k + t * k_stride) + (int64_t)h * D;
        uint8_t* codes = (which ? vc : kc) + b * code_bytes;
        uint16_t* scales = (which ? vsc : ksc) + b * scale_elems;
        alignas(16) int8_t c[D];
        uint16_t sc[D / 16];
        quantize_vector(x, gsize, levels, c, sc);
        for (int g = 0; g < NG; ++g) scales[(int64_t)g * bs + j] = sc[g];
        if (BITS == 8 && !which) {  // K: a dword per 4 dims, code + 128
          for (int o = 0; o < D / 4; ++o) {
            uint32_t w;
            memcpy(&w, c + 4 * o, 4);
            w ^= 0x80808080u;
            memcpy(codes + ((int64_t)o * bs + j) * 4, &w, 4);
          }
          continue;
        }
        for (int d = 0; d < D; ++d) {
          int shift;
          const int64_t at = which ? v_byte<BITS>(j, d, &shift) : k_byte<BITS>(bs, j, d, &shift);
          if constexpr (BITS == 8) {
            codes[at] = (uint8_t)c[d];
          } else {
            codes[at] = (uint8_t)((codes[at] & (0xF0 >> shift)) | ((c[d] + 8) << shift));
          }
        }
      }
}

// The dequantized K and V of `slots` as fp32 [n, kv_heads, D]: code x scale, as kv_quant.dequantize.
template <int BITS>
void load_kv(const uint8_t* kc, const uint8_t* vc, const uint16_t* ksc, const uint16_t* vsc, const int64_t* slots,
             int n, int num_kv_heads, int bs, float* k_out, float* v_out) {
  constexpr int NG = scale_groups<BITS>();
  const int64_t code_bytes = (int64_t)bs * D * BITS / 8, scale_elems = (int64_t)bs * NG;
  for (int t = 0; t < n; ++t) {
    const int64_t block = slots[t] / bs;
    const int j = (int)(slots[t] % bs);
    for (int h = 0; h < num_kv_heads; ++h) {
      const int64_t b = block * num_kv_heads + h;
      for (int which = 0; which < 2; ++which) {
        const uint8_t* codes = (which ? vc : kc) + b * code_bytes;
        const uint16_t* scales = (which ? vsc : ksc) + b * scale_elems;
        float* out = (which ? v_out : k_out) + ((int64_t)t * num_kv_heads + h) * D;
        for (int d = 0; d < D; ++d) {
          int shift;
          const int64_t at = which ? v_byte<BITS>(j, d, &shift) : k_byte<BITS>(bs, j, d, &shift);
          int c;
          if constexpr (BITS == 8) {
            c = which ? (int)(int8_t)codes[at] : (int)codes[at] - 128;
          } else {
            c = ((codes[at] >> shift) & 0xF) - 8;
          }
          out[d] = (float)c * fp32(scales[(int64_t)(d / (D / NG)) * bs + j]);
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// k, v [tokens, kv_heads, D] (fp32 or bf16, token strides given) quantized into their slots; slots < 0 skipped.
int bj_store_kv_quant(const void* k, int64_t k_stride, const void* v, int64_t v_stride, void* k_codes, void* v_codes,
                      void* k_scales, void* v_scales, const int64_t* slots, int tokens, int num_kv_heads, int block_size,
                      int bits, int dtype, int num_threads) {
  if (block_size % 4) return -2;
  uint8_t *kc = (uint8_t*)k_codes, *vc = (uint8_t*)v_codes;
  uint16_t *ks = (uint16_t*)k_scales, *vs = (uint16_t*)v_scales;
#define BJ_STORE(B, T) store_kv<B, T>((const T*)k, (const T*)v, k_stride, v_stride, kc, vc, ks, vs, slots, tokens, num_kv_heads, block_size, num_threads)
  if (bits == 8 && dtype == 0) BJ_STORE(8, float);
  else if (bits == 8 && dtype == 1) BJ_STORE(8, uint16_t);
  else if (bits == 4 && dtype == 0) BJ_STORE(4, float);
  else if (bits == 4 && dtype == 1) BJ_STORE(4, uint16_t);
  else return -1;
#undef BJ_STORE
  return 0;
}

// The dequantized K and V of `slots` (every one valid) as fp32 [n, kv_heads, D] each.
int bj_load_kv_quant(const void* k_codes, const void* v_codes, const void* k_scales, const void* v_scales,
                     const int64_t* slots, int n, int num_kv_heads, int block_size, int bits, float* k_out, float* v_out) {
  const uint8_t *kc = (const uint8_t*)k_codes, *vc = (const uint8_t*)v_codes;
  const uint16_t *ks = (const uint16_t*)k_scales, *vs = (const uint16_t*)v_scales;
  if (bits == 8) load_kv<8>(kc, vc, ks, vs, slots, n, num_kv_heads, block_size, k_out, v_out);
  else if (bits == 4) load_kv<4>(kc, vc, ks, vs, slots, n, num_kv_heads, block_size, k_out, v_out);
  else return -1;
  return 0;
}

}  // extern "C"
