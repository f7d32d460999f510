"""Quantized KV cache (`--kv-cache-dtype int8|int4`): K and V are quantized as they are stored and
dequantized where attention reads them, with scales in a paged tensor beside the cache.

- int8: symmetric absmax per (token, KV head): one fp16 scale per head_dim values, q in [-127, 127].
- int4: symmetric absmax per group of GROUP4 values along head_dim, q in [-7, 7] stored with +8 two per
  byte (dim 2i in the low nibble, 2i+1 in the high one), one fp16 scale per group.

Bytes per token and KV head at head_dim 64 (SmolLM2): bf16 128; int8 64 + 2 = 66 (1.94x the tokens);
int4 32 + 2 x 64/GROUP4 = 40 (3.2x). The torch reference (kernels/reference/attention.py) and the Triton kernels
read `QuantizedKV`; the native CPU kernels keep the same codes and scales in their own layout
(kernels/native/ops.py `PackedKV`, kernels/native/csrc/paged_attention_quant.cpp). Group 16 is
what `python -m batchjob.bench.kv_quality` measured best for int4 on SmolLM2 (perplexity +7% vs +14%
at 32 and +32% at 64, docs/benchmarks.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from batchjob.kernels.modes import KvCacheDtype

KV_DTYPES = tuple(KvCacheDtype)
GROUP4 = 16  # int4: values per scale along head_dim (head_dim itself when smaller); measured best of 16/32/64


def group4(head_dim: int) -> int:
    return min(GROUP4, head_dim)


@dataclass(slots=True)
class QuantizedKV:
    """One layer's K (or V) cache: `data` int8 [blocks, block_size, kv_heads, D] (int4: uint8 [..., D/2]),
    `scale` fp16 [blocks, block_size, kv_heads, groups]."""
    data: torch.Tensor
    scale: torch.Tensor
    bits: int
    head_dim: int

    @classmethod
    def zeros(cls, bits: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, device, alloc=None):
        alloc = alloc or (lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device))
        lead = (num_blocks, block_size, kv_heads)
        if bits == 8:
            return cls(alloc((*lead, head_dim), torch.int8), alloc((*lead, 1), torch.float16), 8, head_dim)
        g = group4(head_dim)
        if head_dim % g or head_dim % 2:
            raise ValueError(f"int4 KV cache: head_dim {head_dim} is not a multiple of {g}")
        return cls(alloc((*lead, head_dim // 2), torch.uint8), alloc((*lead, head_dim // g), torch.float16), 4, head_dim)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical shape [blocks, block_size, kv_heads, head_dim], as an unquantized cache's."""
        return (*self.data.shape[:3], self.head_dim)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data, self.scale

    def store(self, x: torch.Tensor, slots: torch.Tensor) -> None:
        """x [T, kv_heads, D] into the slots (block * block_size + offset); slot -1: skipped."""
        keep = slots >= 0
        if not bool(keep.all()):
            x, slots = x[keep], slots[keep]
        q, s = quantize(x, self.bits)
        hkv = self.data.shape[2]
        self.data.view(-1, hkv, self.data.shape[3]).index_copy_(0, slots, q)
        self.scale.view(-1, hkv, self.scale.shape[3]).index_copy_(0, slots, s)

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[S, L] slots -> dequantized [S, kv_heads, L, D] in `dtype`."""
        s, length = slots.shape
        hkv = self.data.shape[2]
        flat = slots.reshape(-1)
        q = self.data.view(-1, hkv, self.data.shape[3]).index_select(0, flat)
        sc = self.scale.view(-1, hkv, self.scale.shape[3]).index_select(0, flat)
        x = dequantize(q, sc, self.bits, self.head_dim, dtype)
        return x.view(s, length, hkv, self.head_dim).transpose(1, 2)


def quantized_kv_caches(bits: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                        alloc) -> tuple[QuantizedKV, QuantizedKV]:
    """A layer's K and V caches in this layout (the references' and Triton's); `alloc(shape, dtype)`. The
    native kernels have their own (kernels/native/ops.py `NativeKernels.quantized_kv_caches`)."""
    return tuple(QuantizedKV.zeros(bits, num_blocks, block_size, kv_heads, head_dim, None, alloc) for _ in range(2))


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes, fp16 scales [..., groups]): symmetric absmax, rounded to nearest."""
    xf = x.float()
    if bits == 8:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / 127).to(torch.float16)
        sf = scale.float()
        q = torch.round(xf / torch.where(sf > 0, sf, 1.0)).clamp_(-127, 127).to(torch.int8)
        return q, scale
    g = xf.view(*xf.shape[:-1], -1, group4(xf.shape[-1]))
    scale = (g.abs().amax(dim=-1) / 7).to(torch.float16)
    sf = scale.float()[..., None]
    q = (torch.round(g / torch.where(sf > 0, sf, 1.0)).clamp_(-7, 7) + 8).to(torch.uint8).view(*xf.shape)
    return (q[..., 0::2] | (q[..., 1::2] << 4)), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, bits: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    if bits == 8:
        return (q.float() * scale.float()).to(dtype)
    lo = (q & 0xF).to(torch.int8) - 8
    hi = (q >> 4).to(torch.int8) - 8
    vals = torch.stack([lo, hi], dim=-1).view(*q.shape[:-1], head_dim).float()
    size = group4(head_dim)
    g = vals.view(*vals.shape[:-1], head_dim // size, size) * scale.float()[..., None]
    return g.view(*vals.shape).to(dtype)


def bytes_per_token_head(kv_dtype: str, head_dim: int, dtype: torch.dtype) -> int:
    """K (or V) bytes per token and KV head in the cache, scales included."""
    if kv_dtype == KvCacheDtype.INT8:
        return head_dim + 2
    if kv_dtype == KvCacheDtype.INT4:
        return head_dim // 2 + 2 * math.ceil(head_dim / group4(head_dim))
    return head_dim * dtype.itemsize
