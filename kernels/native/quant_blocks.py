"""The compiled CPU matmul on block-quantized weights (kernels/native/csrc/quant_blocks.cpp), through ctypes: GGUF's
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K blocks and group-wise int4, packed once at load (`pack_gguf`,
`pack_codes`) and computed as stored (`linear`: the activations quantized per block of 32 in the call, exact int32
sums per group, the scales applied in fp32), and columns dequantized as gguf computes them (`dequant_cols`: an
embedding lookup on the packed weight).

Built for the instruction-set path kernels/native/build.py picks (`cpu_isa()`, or `BATCHJOB_CPU_ISA`); every path
gives bitwise the same results (the source's header says why). `native_quant_blocks()` returns None where the
library cannot be built (no compiler): a loader then dequantizes the weights at load instead."""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from batchjob.kernels.native.build import BuildError, build, cpu_isa
from batchjob.notices import notice

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
NB = 64  # output columns per packed block
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class ScaleKind(IntEnum):
    """How a format stores its scales (quant_blocks.cpp ScaleKind)."""
    F16 = 0  # fp16 d (and m) per group of 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
    KQ = 1  # fp16 D and Dmin per 256, 6-bit scales and mins per 32: Q4_K, Q5_K
    K6 = 2  # fp16 D per 256, int8 scales per 16: Q6_K
    F32 = 3  # fp32 d (and m) per group (a multiple of 32): int4 quantized at load or by a checkpoint


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """A packed weight's format: w = d_g * u + m_g per group g of `group` weights along k, u unsigned of `bits`;
    symmetric formats have m_g = -offset * d_g (`offset` >= 0), the others a stored min (`offset` -1)."""
    name: str  # for messages and the start line: "Q4_K", "int4 g128"
    bits: int
    group: int
    offset: int
    kind: ScaleKind

    @property
    def args(self) -> tuple[int, int, int, int]:
        return self.bits, self.group, self.offset, int(self.kind)

    @property
    def activation_block(self) -> int:
        """Activation values per int8 block in a call: 256 for the K-quants (llama.cpp's Q8_K), else 32 (its Q8_0)."""
        return 256 if self.kind in (ScaleKind.KQ, ScaleKind.K6) else 32

    @property
    def bits_per_weight(self) -> float:
        """What one weight costs in memory, scales included."""
        scales = {ScaleKind.F16: 16 * (1 if self.offset >= 0 else 2) / 32,
                  ScaleKind.F32: 32 * (1 if self.offset >= 0 else 2) / self.group,
                  ScaleKind.KQ: (32 + 8 * 16) / 256, ScaleKind.K6: (16 + 16 * 8) / 256}[self.kind]
        return (8 if self.bits >= 6 else self.bits) + scales  # 6-bit codes are kept as bytes (quant_blocks.cpp)


# GGUF types computed as stored (gguf.GGMLQuantizationType values): what each file block holds, in our terms
GGUF_FORMATS: dict[int, BlockFormat] = {
    2: BlockFormat("Q4_0", 4, 32, 8, ScaleKind.F16),
    3: BlockFormat("Q4_1", 4, 32, -1, ScaleKind.F16),
    6: BlockFormat("Q5_0", 5, 32, 16, ScaleKind.F16),
    7: BlockFormat("Q5_1", 5, 32, -1, ScaleKind.F16),
    8: BlockFormat("Q8_0", 8, 32, 128, ScaleKind.F16),
    12: BlockFormat("Q4_K", 4, 32, -1, ScaleKind.KQ),
    13: BlockFormat("Q5_K", 5, 32, -1, ScaleKind.KQ),
    14: BlockFormat("Q6_K", 6, 16, 32, ScaleKind.K6),
}
GGUF_BLOCK = {2: 32, 3: 32, 6: 32, 7: 32, 8: 32, 12: 256, 13: 256, 14: 256}  # weights per file block


@dataclass(frozen=True, slots=True)
class PackedBlocks:
    """One [n, k] weight packed for the kernel: `codes` and `scales` uint8 (quant_blocks.cpp's layout, per block of
    64 output columns)."""
    fmt: BlockFormat
    codes: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel()


class NativeQuantBlocks:
    """pack_gguf / pack_codes (at load), linear and dequant_cols (per call) on CPU tensors. `isa` is the path it was
    built for, `kernel` the micro-kernel on that path (avx512-vnni | avx2 | generic)."""

    def __init__(self, lib: ctypes.CDLL, isa: str = ""):
        def fn(name, args, res=_I):
            f = getattr(lib, name)
            f.argtypes, f.restype = args, res
            return f

        self._bytes = fn("bj_qpacked_bytes", [_I, _I, _I, _I, _I, _I, _I], _I64)
        self._gguf_format = fn("bj_qgguf_format", [_I, _P])
        self._pack_gguf = fn("bj_qpack_gguf", [_I, _P, _I64, _I, _I, _P, _P, _I])
        self._pack_codes = fn("bj_qpack_codes", [_I, _I, _I, _P, _P, _P, _I, _I, _P, _P, _I])
        self._linear = fn("bj_qlinear", [_P, _I64, _I, _I, _I, _I, _I, _I, _I, _P, _P, _I, _P, _P, _I64, _I, _I])
        self._dequant = fn("bj_qdequant_cols", [_I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _P, _I, _I])
        self.kernel: str = fn("bj_qlinear_kernel", [], ctypes.c_char_p)().decode()
        self.isa = isa
        self._lib = lib

    def gguf_format(self, gguf_type: int) -> BlockFormat | None:
        """The library's own reading of a GGUF type (None: not computed as stored); GGUF_FORMATS must agree."""
        out = (ctypes.c_int * 4)()
        if self._gguf_format(gguf_type, out):
            return None
        known = GGUF_FORMATS[gguf_type]
        return BlockFormat(known.name, out[0], out[1], out[2], ScaleKind(out[3]))

    def _empty(self, fmt: BlockFormat, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        cb, sb = (self._bytes(*fmt.args, n, k, s) for s in (0, 1))
        if not cb or not sb:
            raise ValueError(f"{fmt.name}: a weight [{n}, {k}] cannot be packed (k must be a multiple of "
                             f"{256 if fmt.kind in (ScaleKind.KQ, ScaleKind.K6) else max(32, fmt.group)})")
        return torch.empty(cb, dtype=torch.uint8), torch.empty(sb, dtype=torch.uint8)

    def pack_gguf(self, raw: np.ndarray, gguf_type: int, k: int) -> PackedBlocks:
        """A GGUF tensor's rows of blocks [n, row_bytes] (uint8, e.g. a view of the mapped file; row r: output r's k
        weights) -> packed."""
        fmt = GGUF_FORMATS[gguf_type]
        raw = np.ascontiguousarray(raw)
        if raw.dtype != np.uint8 or raw.ndim != 2:
            raise ValueError(f"{fmt.name}: raw blocks must be uint8 [rows, bytes], not {raw.dtype} {raw.shape}")
        n = raw.shape[0]
        codes, scales = self._empty(fmt, n, k)
        if self._pack_gguf(gguf_type, raw.ctypes.data, raw.shape[1], n, k, codes.data_ptr(), scales.data_ptr(),
                           torch.get_num_threads()):
            raise ValueError(f"{fmt.name}: rows of {raw.shape[1]} bytes do not hold {k} weights")
        return PackedBlocks(fmt, codes, scales, n, k)

    def pack_codes(self, u: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, fmt: BlockFormat) -> PackedBlocks:
        """Unsigned codes u [n, k] (uint8, < 2**bits) with fp32 d (and m: None for a symmetric format) [n, k / group]
        -> packed (ScaleKind.F32)."""
        if fmt.kind != ScaleKind.F32 or (m is None) != (fmt.offset >= 0):
            raise ValueError(f"{fmt.name}: pack_codes takes fp32 scales, with mins exactly when the format has them")
        u = u.to(torch.uint8).contiguous()
        d = d.float().contiguous()
        m = None if m is None else m.float().contiguous()
        n, k = u.shape
        codes, scales = self._empty(fmt, n, k)
        if self._pack_codes(fmt.bits, fmt.group, fmt.offset, u.data_ptr(), d.data_ptr(), None if m is None else m.data_ptr(),
                            n, k, codes.data_ptr(), scales.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"{fmt.name}: codes {tuple(u.shape)} with scales {tuple(d.shape)} cannot be packed")
        return PackedBlocks(fmt, codes, scales, n, k)

    def linear(self, x: torch.Tensor, w: PackedBlocks, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """x [M, k] fp32/bf16 (rows may be strided) @ w.T (+ bias fp32 [n]) into `out` [M, n] (fp32/bf16; a column
        slice of a wider output is fine: its row stride is kept)."""
        if x.dim() != 2 or x.shape[1] != w.k or out.shape != (x.shape[0], w.n) or out.stride(1) != 1:
            raise ValueError(f"quantized linear: x {tuple(x.shape)} -> out {tuple(out.shape)} for a weight [{w.n}, {w.k}]")
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        err = self._linear(x.data_ptr(), x.stride(0) if rows > 1 else w.k, _DTYPE_CODES[x.dtype], rows, w.k, *w.fmt.args,
                           w.codes.data_ptr(), w.scales.data_ptr(), w.n, None if bias is None else bias.data_ptr(),
                           out.data_ptr(), out.stride(0) if rows > 1 else w.n, _DTYPE_CODES[out.dtype],
                           torch.get_num_threads())
        if err:
            raise RuntimeError(f"native quantized linear refused x {tuple(x.shape)} {x.dtype} @ {w.fmt.name} [{w.n}, {w.k}]")
        return out

    def dequant_cols(self, w: PackedBlocks, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the [n, k] weight (an embedding lookup) in fp32 or bf16, as gguf's dequantize computes them."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty((ids.numel(), w.k), dtype=dtype if dtype in _DTYPE_CODES else torch.float32)
        err = self._dequant(*w.fmt.args, w.codes.data_ptr(), w.scales.data_ptr(), w.n, w.k, ids.data_ptr(), ids.numel(),
                            out.data_ptr(), _DTYPE_CODES[out.dtype], torch.get_num_threads())
        if err:
            raise IndexError(f"{w.fmt.name} rows: ids outside [0, {w.n})" if err == 2 else f"{w.fmt.name}: dequantize refused")
        return out if out.dtype == dtype else out.to(dtype)


def native_quant_blocks(isa: str | None = None) -> NativeQuantBlocks | None:
    """The compiled ops for the `isa` path (default: `cpu_isa()`), or None (said once) where they cannot be built."""
    try:
        isa = isa or cpu_isa()
    except BuildError as e:
        return _unavailable(str(e))
    return _native_for(isa)


@functools.cache
def _native_for(isa: str) -> NativeQuantBlocks | None:
    try:
        return NativeQuantBlocks(ctypes.CDLL(str(build("quant_blocks.cpp", {}, log=notice, isa=isa))), isa)
    except (BuildError, OSError) as e:
        return _unavailable(str(e))


@functools.cache
def _unavailable(why: str) -> None:
    notice(f"quantized weights: native kernel unavailable ({why}); GGUF and int4 weights are dequantized at load "
           "instead (more memory, the same text as --quantization none)")
    return None
