"""Triton side of the int8 KV cache (kernels/reference/kv_quant.py): the quantizing KV store, and the load that
attention kernels use to read K/V (dequantized into the compute dtype where the cache is int8). Must
equal QuantizedKV.store / .gather: absmax per (token, KV head), an fp16 scale, codes rounded half to even."""
from __future__ import annotations

from batchjob.kernels.reference.kv_quant import group4

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but the CPU paths do not need it
    triton = load_kv = None

if triton is not None:

    @triton.jit
    def load_kv(X, XS, slot, h, d, mask, num_kv_heads, D: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
                dtype: tl.constexpr):
        """K or V of the keys in cache slots `slot` [BLOCK], KV head `h`, dims `d` [D_PAD], in `dtype`: plain
        values (QUANT 0), int8 codes x their token's scale (8), or int4 nibbles - 8 x their group's scale (4)."""
        if QUANT == 4:
            ng = D // GROUP
            byte = tl.load(X + slot[:, None] * (num_kv_heads * (D // 2)) + h * (D // 2) + d[None, :] // 2, mask=mask,
                           other=0)
            nib = (byte.to(tl.int32) >> ((d[None, :] % 2) * 4)) & 0xF
            s = tl.load(XS + slot[:, None] * (num_kv_heads * ng) + h * ng + d[None, :] // GROUP, mask=mask, other=0.0)
            out = ((nib - 8).to(tl.float32) * s.to(tl.float32)).to(dtype)
        elif QUANT == 8:
            x = tl.load(X + slot[:, None] * (num_kv_heads * D) + h * D + d[None, :], mask=mask, other=0).to(tl.float32)
            s = tl.load(XS + slot * num_kv_heads + h, mask=slot >= 0, other=0.0).to(tl.float32)
            out = (x * s[:, None]).to(dtype)
        else:
            out = tl.load(X + slot[:, None] * (num_kv_heads * D) + h * D + d[None, :], mask=mask, other=0.0)
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
    def _quantize_row4(X, C, S, src, slot, HKV: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr,
                       GROUP: tl.constexpr):
        """int4: even and odd dims loaded apart, grouped [heads, groups, GROUP/2] for the absmax, packed as
        (even + 8) | (odd + 8) << 4."""
        NG: tl.constexpr = D // GROUP
        HALF: tl.constexpr = GROUP // 2
        hh = tl.arange(0, H_PAD)
        i = tl.arange(0, D // 2)
        m = (hh < HKV)[:, None] & (i < D // 2)[None, :]
        base = X + src + hh[:, None] * D + 2 * i[None, :]
        even = tl.reshape(tl.load(base, mask=m, other=0.0).to(tl.float32), (H_PAD, NG, HALF))
        odd = tl.reshape(tl.load(base + 1, mask=m, other=0.0).to(tl.float32), (H_PAD, NG, HALF))
        amax = tl.maximum(tl.max(tl.abs(even), 2), tl.max(tl.abs(odd), 2))
        scale = (amax / 7.0).to(tl.float16)
        sf = tl.where(scale.to(tl.float32) > 0, scale.to(tl.float32), 1.0)[:, :, None]
        lo = _code4(even / sf, H_PAD, D)
        hi = _code4(odd / sf, H_PAD, D)
        tl.store(C + slot * (HKV * (D // 2)) + hh[:, None] * (D // 2) + i[None, :], (lo | (hi << 4)).to(tl.uint8), mask=m)
        g = tl.arange(0, NG)
        tl.store(S + slot * (HKV * NG) + hh[:, None] * NG + g[None, :], scale, mask=(hh < HKV)[:, None] & (g < NG)[None, :])

    @triton.jit
    def _code4(y, H_PAD: tl.constexpr, D: tl.constexpr):
        """Scaled values [heads, groups, GROUP/2] -> int4 codes + 8, rounded half to even, [heads, D/2]."""
        r = tl.floor(y + 0.5)
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0
        r = tl.where(((r - y) == 0.5) & odd, r - 1.0, r)
        return tl.reshape(tl.minimum(tl.maximum(r, -7.0), 7.0) + 8.0, (H_PAD, D // 2)).to(tl.int32)

    @triton.jit
    def _store_kv_quantized_kernel(K, V, KC, VC, KS, VS, SLOTS, stride_k, stride_v, BITS: tl.constexpr,
                                   HKV: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
                                   GROUP: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(SLOTS + t).to(tl.int64)
        if slot >= 0:
            if BITS == 8:
                _quantize_row(K, KC, KS, t * stride_k, slot, HKV, D, H_PAD, D_PAD)
                _quantize_row(V, VC, VS, t * stride_v, slot, HKV, D, H_PAD, D_PAD)
            else:
                _quantize_row4(K, KC, KS, t * stride_k, slot, HKV, D, H_PAD, GROUP)
                _quantize_row4(V, VC, VS, t * stride_v, slot, HKV, D, H_PAD, GROUP)


def store_kv_quantized(k, v, k_cache, v_cache, slot_mapping) -> None:
    t, hkv, d = k.shape
    k, v = k.contiguous(), v.contiguous()
    if t:
        _store_kv_quantized_kernel[(t,)](
            k, v, k_cache.data, v_cache.data, k_cache.scale, v_cache.scale, slot_mapping, k.stride(0), v.stride(0),
            BITS=k_cache.bits, HKV=hkv, D=d, H_PAD=triton.next_power_of_2(hkv), D_PAD=triton.next_power_of_2(d),
            GROUP=group4(d) if k_cache.bits == 4 else 1)
