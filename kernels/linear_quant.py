"""Weight matmuls on block-quantized weights computed as stored: GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and
Q6_K (what Q4_K_M, Q5_K_M, Q6_K and Q8_0 files hold) and group-wise int4 (`--quantization int4`, compressed-tensors
W4A16), on the CPU (kernels/native/csrc/quant_blocks.cpp, every path of vec.h: AVX-512 with VNNI, AVX2, generic).

A loader hands a weight over as a `PackedWeight`: one or more packed parts along the output dimension (a fused
QKV of a Q4_K_M file is Q4_K for q and k and Q6_K for v), each in its file's blocks, repacked once at load for the
kernel and taking the file's bytes in memory. `BlockQuantLinear` runs it: per call the activations are quantized per
block of 32 of each row (so a row's result never depends on its batch), each part writes its columns of one output.
The same PackedWeight serves an embedding lookup (`rows`, the values gguf's dequantize gives, bitwise), so a tied
LM head and the embeddings share one copy.

Where the native library is not built (no compiler) or the device is not a CPU, loaders dequantize instead
(`native_quant_blocks()` is None there); `PackedWeight.dequantized` gives the exact values for that and for tests.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from batchjob.kernels.native.quant_blocks import NB, BlockFormat, PackedBlocks, ScaleKind, native_quant_blocks

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(slots=True)
class PackedWeight:
    """A weight [n, k] as packed parts along n (concatenated in order), computed as stored."""
    parts: list[PackedBlocks]

    def __post_init__(self):
        if not self.parts or len({p.k for p in self.parts}) != 1:
            raise ValueError("PackedWeight: one or more parts of one input size")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.n for p in self.parts), self.parts[0].k))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def memory(self) -> dict[str, int]:
        """Bytes in memory per format name."""
        out: Counter[str] = Counter()
        for p in self.parts:
            out[p.fmt.name] += p.nbytes
        return dict(out)

    @property
    def formats(self) -> Counter[str]:
        """Weights per format name."""
        c: Counter[str] = Counter()
        for p in self.parts:
            c[p.fmt.name] += p.n * p.k
        return c

    def to(self, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> PackedWeight:
        """Itself on the CPU (`dtype`, the compute dtype, leaves the packing as it is); elsewhere build_model
        dequantizes first."""
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError("PackedWeight: packed weights compute on the CPU; dequantize them for another device")
        return self

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """Every value, as gguf's dequantize computes it (fp32), in `dtype`."""
        native = _native()
        return torch.cat([native.dequant_cols(p, torch.arange(p.n), torch.float32) for p in self.parts]).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight (an embedding lookup) -> [*ids.shape, k] in `dtype`."""
        if len(self.parts) != 1:
            return self.dequantized(dtype)[ids]
        return _native().dequant_cols(self.parts[0], ids, dtype).view(*ids.shape, self.parts[0].k)

    @staticmethod
    def cat(parts: list[PackedWeight]) -> PackedWeight:
        """Weights concatenated along n (a fused projection): adjacent parts of one format whose earlier part fills
        whole 64-column blocks are merged into one (one kernel call for them); the others stay separate parts."""
        merged: list[PackedBlocks] = []
        for p in (b for w in parts for b in w.parts):
            last = merged[-1] if merged else None
            if last is not None and last.fmt == p.fmt and last.n % NB == 0:
                merged[-1] = PackedBlocks(p.fmt, torch.cat([last.codes, p.codes]), torch.cat([last.scales, p.scales]),
                                          last.n + p.n, p.k)
            else:
                merged.append(p)
        return PackedWeight(merged)


@dataclass(slots=True)
class Int4Weight:
    """A weight [n, k] in group-wise 4-bit integers, as `--quantization int4` quantizes a float weight at load and a
    compressed-tensors W4A16 checkpoint stores one: unsigned codes `u` [n, k] (uint8, 0..15) and fp32 `scales`
    [n, k / group]; the value is scales * (u - 8) (symmetric), or scales * u + mins with fp32 `mins` [n, k / group]
    (an asymmetric checkpoint's zero points folded in). Where it runs: on a CPU packed and computed as stored
    (BlockQuantLinear: `packed()`), on CUDA by the Triton W4A16 kernel (kernels/linear_w4a16.py), else dequantized."""
    u: torch.Tensor
    scales: torch.Tensor
    group: int
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.u.shape

    @property
    def fmt(self) -> BlockFormat:
        return BlockFormat(f"int4 g{self.group}", 4, self.group, 8 if self.mins is None else -1, ScaleKind.F32)

    def to(self, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Int4Weight:
        """On `device`; `dtype` (the compute dtype) leaves codes and scales as they are."""
        return Int4Weight(self.u.to(device), self.scales.to(device), self.group,
                          None if self.mins is None else self.mins.to(device))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """Its values (fp32 products, as the packed weight's `dequantized`), in `dtype`."""
        d = self.scales.float().repeat_interleave(self.group, dim=1)
        if self.mins is None:
            return (d * (self.u.float() - 8)).to(dtype)
        return (d * self.u.float() + self.mins.float().repeat_interleave(self.group, dim=1)).to(dtype)

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Parts of one group size concatenated along n (a fused projection)."""
        if len({p.group for p in parts}) != 1 or len({p.mins is None for p in parts}) != 1:
            raise ValueError("int4: parts of one projection with different groups or zero points")
        return Int4Weight(torch.cat([p.u for p in parts]), torch.cat([p.scales for p in parts]), parts[0].group,
                          None if parts[0].mins is None else torch.cat([p.mins for p in parts]))

    def packable(self) -> bool:
        """Whether the CPU kernel computes it as stored: groups of a multiple of 32 weights."""
        return self.group % 32 == 0 and self.u.shape[1] % self.group == 0

    def packed(self) -> PackedWeight:
        return PackedWeight([_native().pack_codes(self.u, self.scales, self.mins, self.fmt)])


def quantize_int4(w: torch.Tensor, group: int = 32) -> Int4Weight:
    """A float weight [n, k] -> symmetric group-wise int4 (`--quantization int4`), Q4_0's rule with an fp32 scale:
    per group d = v / -8 for v its value of largest magnitude, u = trunc(w / d + 8.5) clamped to [0, 15] (so v is
    exactly -8 d), computed in fp32."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4: a weight of {k} inputs is not a multiple of the group size {group}")
    g = w.float().reshape(n, k // group, group)
    peak = torch.gather(g, 2, g.abs().argmax(dim=2, keepdim=True))
    d = peak / -8.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    u = torch.trunc(g * inv + 8.5).clamp_(0, 15).to(torch.uint8)
    return Int4Weight(u.reshape(n, k), d.reshape(n, k // group), group)


def _native():
    native = native_quant_blocks()
    if native is None:
        raise RuntimeError("packed weights need the native quantized-matmul library, which cannot be built here")
    return native


class BlockQuantLinear:
    """x [..., k] -> x @ W.T (+ bias) [..., n] in x's dtype (fp32 and bf16 natively; others through fp32), W a
    PackedWeight computed as stored."""

    __slots__ = ("weight", "bias", "out_features", "kernel", "_native", "_bounds")

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None):
        self.weight = weight
        self.out_features = weight.shape[0]
        self.bias = None if bias is None else bias.float().contiguous()
        self._native = _native()
        self.kernel = f"native-{self._native.kernel}"  # for logs and tests: the micro-kernel that runs
        starts = [0]
        for p in weight.parts:
            starts.append(starts[-1] + p.n)
        self._bounds = list(zip(starts, starts[1:]))

    @property
    def formats(self) -> Counter[str]:
        return self.weight.formats

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def memory(self) -> dict[str, int]:
        out = self.weight.memory()
        if self.bias is not None:
            out["float32"] = out.get("float32", 0) + self.bias.numel() * 4
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        dtype = x.dtype
        if dtype not in _NATIVE_DTYPES:
            return self(x.float()).to(dtype)
        out = torch.empty((x.shape[0], self.out_features), dtype=dtype)
        for p, (s, e) in zip(self.weight.parts, self._bounds):
            self._native.linear(x, p, None if self.bias is None else self.bias[s:e], out[:, s:e])
        return out

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch reference of `self(x)` for tests (float64, per part: kernels/reference/quant_blocks.py)."""
        from batchjob.kernels.reference.quant_blocks import block_quant_matmul

        x2 = x.reshape(-1, x.shape[-1])
        out = torch.cat([block_quant_matmul(x2, PackedWeight([p]).dequantized(torch.float32),
                                            None if self.bias is None else self.bias[s:e], p.fmt.activation_block)
                         for p, (s, e) in zip(self.weight.parts, self._bounds)], dim=1)
        return out.view(*x.shape[:-1], self.out_features)
