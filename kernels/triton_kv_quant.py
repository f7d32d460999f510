"""Triton side of the int8 KV cache (kernels/kv_quant.py): the quantizing KV store, and the load that
attention kernels use to read K/V (dequantized into the compute dtype where the cache is int8). Must
equal QuantizedKV.store / .gather: absmax per (token, KV head), an fp16 scale, codes rounded half to even."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but the CPU paths do not need it
    triton = load_kv = None

if triton is not None:

    @triton.jit
    def load_kv(X, XS, ptr, sptr, mask, smask, QUANT: tl.constexpr, dtype: tl.constexpr):
        """K or V rows at `ptr` (codes) with their scales at `sptr` when QUANT == 8, else plain values."""
        if QUANT == 8:
            x = tl.load(X + ptr, mask=mask, other=0).to(tl.float32)
            s = tl.load(XS + sptr, mask=smask, other=0.0).to(tl.float32)
            out = (x * s[:, None]).to(dtype)
        else:
            out = tl.load(X + ptr, mask=mask, other=0.0)
        return out

    @triton.jit
    def _quantize_row(X, C, S, src, slot, HKV: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr,
                      D_PAD: tl.constexpr):
        hh = tl.arange(0, H_PAD)
        d = tl.arange(0, D_PAD)
        hm = hh < HKV
        m = hm[:, None] & (d < D)[None, :]
        off = hh[:, None] * D + d[None, :]
        x = tl.load(X + src + off, mask=m, other=0.0).to(tl.float32)
        scale = (tl.max(tl.abs(x), 1) / 127.0).to(tl.float16)
        sf = scale.to(tl.float32)
        y = x / tl.where(sf > 0, sf, 1.0)[:, None]
        r = tl.floor(y + 0.5)  # torch.round: half to even
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0
        r = tl.where(((r - y) == 0.5) & odd, r - 1.0, r)
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        tl.store(C + slot * (HKV * D) + off, r.to(tl.int8), mask=m)
        tl.store(S + slot * HKV + hh, scale, mask=hm)

    @triton.jit
    def _store_kv_int8_kernel(K, V, KC, VC, KS, VS, SLOTS, stride_k, stride_v, HKV: tl.constexpr, D: tl.constexpr,
                              H_PAD: tl.constexpr, D_PAD: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(SLOTS + t).to(tl.int64)
        if slot >= 0:
            _quantize_row(K, KC, KS, t * stride_k, slot, HKV, D, H_PAD, D_PAD)
            _quantize_row(V, VC, VS, t * stride_v, slot, HKV, D, H_PAD, D_PAD)


def store_kv_int8(k, v, k_cache, v_cache, slot_mapping, pow2) -> None:
    t, hkv, d = k.shape
    k, v = k.contiguous(), v.contiguous()
    if t:
        _store_kv_int8_kernel[(t,)](k, v, k_cache.data, v_cache.data, k_cache.scale, v_cache.scale, slot_mapping,
                                    k.stride(0), v.stride(0), HKV=hkv, D=d, H_PAD=pow2(hkv), D_PAD=pow2(d))
