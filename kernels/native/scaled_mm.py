"""The compiled CPU int8 matmul (kernels/native/csrc/scaled_mm.cpp), loaded through ctypes: the whole W8A8 call
in one (`int8_linear`: per-row quantization, the integer GEMM on a weight packed at load by `pack_weight`, the
rescale), and its two ends alone (`quantize_rows`, `rescale`) around another GEMM.

The library is built for the instruction-set path kernels/native/build.py picks (`cpu_isa()`, or
`BATCHJOB_CPU_ISA`), and the GEMM runs that path's micro-kernel (`NativeScaledMM.gemm_kernel`): `avx512-vnni`
(`vpdpbusd` on zmm), `avx-vnni` (`vpdpbusd` on ymm, AVX2 CPUs with AVX-VNNI), `avx2` (`vpmaddubsw` + `vpmaddwd` on
|q| and the weight's bytes flipped by q's sign, exact; AMD Zen 2/3, older Intel; also AVX-512 without VNNI) or
`generic` (plain integer loops). The packed weight is the same on every path, and every path gives bitwise the
same results (the int32 sums are exact; the quantize and rescale are the reference's fp32 operations in order).

`native_scaled_mm()` builds the library at first use and returns None where it cannot (no compiler): the int8
linear then runs `_int_mm` between the torch references' quantize and rescale (kernels/linear_int8.py)."""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from batchjob.kernels.native.build import BuildError, build, cpu_isa
from batchjob.notices import notice

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_CODES, _SUMS = 2, 2  # bj_int8_linear's x given as int8 codes; its output as the int32 sums
NB, K_QUAD = 64, 4  # the packed weight's blocks: 64 output columns x k in quads (scaled_mm.cpp)
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


@dataclass(frozen=True, slots=True)
class PackedInt8:
    """An int8 weight [n, k] as bj_int8_linear reads it, the same on every path: `data` [ceil(n/64) * kp * 64] int8
    (blocks of 64 columns x k in quads; kp = k rounded up to 4; zeros in the padding), `corr` [ceil(n/64) * 64]
    int32 (128 * each column's sum: vpdpbusd's shift, read by the VNNI kernels only)."""
    data: torch.Tensor
    corr: torch.Tensor
    n: int
    k: int

    @property
    def kp(self) -> int:
        return -(-self.k // K_QUAD) * K_QUAD

    def codes(self) -> torch.Tensor:
        """The int8 weight [n, k] back out of the packing."""
        blocks = self.data.view(-1, self.kp // K_QUAD, NB, K_QUAD)  # [block, quad, column, byte]
        return blocks.permute(0, 2, 1, 3).reshape(-1, self.kp)[:self.n, :self.k].contiguous()


class NativeScaledMM:
    """quantize_rows / rescale, and (where `has_gemm`: every build now) pack_weight / int8_linear / int8_sums, on
    CPU tensors of fp32 or bf16; the same results as the references, bitwise. `isa` is the path it was built for,
    `gemm_kernel` the GEMM's micro-kernel on that path."""

    def __init__(self, lib: ctypes.CDLL, isa: str = ""):
        self._quantize = lib.bj_quantize_rows_int8
        self._quantize.argtypes, self._quantize.restype = [_P, _I64, _I, _I, _I, _P, _P, _I], _I
        self._rescale = lib.bj_rescale_rows
        self._rescale.argtypes, self._rescale.restype = [_P, _I, _I, _I, _P, _P, _P, _P, _I, _I], _I
        self._pack = lib.bj_pack_int8_weight
        self._pack.argtypes, self._pack.restype = [_P, _I, _I, _P, _P, _I], _I
        self._linear = lib.bj_int8_linear
        self._linear.argtypes, self._linear.restype = [_P, _I64, _I, _P, _I, _I, _P, _P, _I, _P, _P, _P, _I, _I], _I
        self.has_gemm = bool(lib.bj_int8_linear_available())
        kernel = lib.bj_int8_linear_kernel
        kernel.argtypes, kernel.restype = [], ctypes.c_char_p
        self.gemm_kernel: str = kernel().decode()  # avx512-vnni | avx-vnni | avx2 | generic
        self.isa = isa
        self._lib = lib  # keeps the library loaded while its functions are held

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _DTYPE_CODES

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] fp32/bf16 (rows may be strided) -> (int8 [M, K], fp32 scales [M, 1]): quantize_rows_int8."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, k = x.shape
        q = torch.empty((rows, k), dtype=torch.int8)
        scale = torch.empty((rows, 1), dtype=torch.float32)
        if self._quantize(x.data_ptr(), x.stride(0) if rows > 1 else k, rows, k, _DTYPE_CODES[x.dtype], q.data_ptr(),
                          scale.data_ptr(), torch.get_num_threads()):
            raise RuntimeError(f"native int8 quantize refused x {tuple(x.shape)} {x.dtype}")
        return q, scale

    def rescale(self, acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
        """acc [M, N] int32 (or fp32 holding the int32 sums) -> (acc * x_scale[M, 1]) * w_scale[N] (+ bias fp32 [N])
        in fp32, rounded to out_dtype: int8_scaled_mm's rescale."""
        acc = acc.contiguous()
        rows, n = acc.shape
        out = torch.empty((rows, n), dtype=out_dtype)
        if self._rescale(acc.data_ptr(), int(acc.dtype == torch.int32), rows, n, x_scale.data_ptr(), w_scale.data_ptr(),
                         None if bias is None else bias.data_ptr(), out.data_ptr(), _DTYPE_CODES[out_dtype],
                         torch.get_num_threads()):
            raise RuntimeError(f"native int8 rescale refused acc {tuple(acc.shape)} -> {out_dtype}")
        return out

    def pack_weight(self, codes: torch.Tensor) -> PackedInt8:
        """int8 codes [n, k] -> the packing bj_int8_linear reads (done once, at load)."""
        codes = codes.contiguous()
        n, k = codes.shape
        kp, blocks = -(-k // K_QUAD) * K_QUAD, -(-n // NB)
        data = torch.empty(blocks * kp * NB, dtype=torch.int8)
        corr = torch.empty(blocks * NB, dtype=torch.int32)
        if self._pack(codes.data_ptr(), n, k, data.data_ptr(), corr.data_ptr(), torch.get_num_threads()):
            raise RuntimeError(f"native int8 packing refused a weight {tuple(codes.shape)}")
        return PackedInt8(data, corr, n, k)

    def int8_linear(self, x: torch.Tensor, w: PackedInt8, w_scale: torch.Tensor, bias: torch.Tensor | None,
                    out_dtype: torch.dtype) -> torch.Tensor:
        """x [M, k] fp32/bf16 (rows may be strided) -> int8_scaled_mm(quantize_rows_int8(x), w) in out_dtype,
        bitwise; w_scale and bias fp32 [n]."""
        return self._call(x, _DTYPE_CODES[x.dtype], w, w_scale, bias, out_dtype, _DTYPE_CODES[out_dtype])

    def int8_sums(self, xq: torch.Tensor, w: PackedInt8) -> torch.Tensor:
        """xq [M, k] int8 codes @ w's codes.T: the exact int32 sums [M, n]."""
        return self._call(xq, _CODES, w, None, None, torch.int32, _SUMS)

    def _call(self, x, x_code, w: PackedInt8, w_scale, bias, out_dtype, out_code) -> torch.Tensor:
        """bj_int8_linear; int8 codes go in with unit scales (the kernel's x_scale argument left null)."""
        if x.dim() != 2 or x.shape[1] != w.k:
            raise ValueError(f"native int8 linear: x {tuple(x.shape)} for a weight [{w.n}, {w.k}]")
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty((rows, w.n), dtype=out_dtype)
        err = self._linear(x.data_ptr(), x.stride(0) if rows > 1 else w.k, x_code, None, rows, w.k, w.data.data_ptr(),
                           w.corr.data_ptr(), w.n, None if w_scale is None else w_scale.data_ptr(),
                           None if bias is None else bias.data_ptr(), out.data_ptr(), out_code, torch.get_num_threads())
        if err:
            raise RuntimeError(f"native int8 linear refused x {tuple(x.shape)} {x.dtype} @ [{w.n}, {w.k}] (code {err})")
        return out


def native_scaled_mm(isa: str | None = None) -> NativeScaledMM | None:
    """The compiled ops for the `isa` path (default: `cpu_isa()`, which reads BATCHJOB_CPU_ISA now, so a test can
    switch paths), or None (said once in a log line) where they cannot be built. One library per path, loaded once."""
    try:
        isa = isa or cpu_isa()
    except BuildError as e:
        return _unavailable(str(e))
    return _native_for(isa)


@functools.cache
def _native_for(isa: str) -> NativeScaledMM | None:
    try:
        return NativeScaledMM(ctypes.CDLL(str(build("scaled_mm.cpp", {}, log=notice, isa=isa))), isa)
    except (BuildError, OSError) as e:
        return _unavailable(str(e))


@functools.cache
def _unavailable(why: str) -> None:
    notice(f"int8 matmuls: native kernel unavailable ({why}); using torch._int_mm and the torch references, "
                "which on most CPUs (all without AMX) run slower than the default matmuls: leave out --quantization int8 "
                "unless the memory matters")
    return None
