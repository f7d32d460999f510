"""The compiled ends of the CPU int8 matmul (kernels/native/csrc/scaled_mm.cpp), loaded through ctypes:
per-row int8 quantization of the activations, and the rescale of the GEMM's sums into the output dtype.

`native_scaled_mm()` builds the library at first use (kernels/native/build.py) and returns None where it
cannot (no compiler, no AVX-512): the int8 linear then runs the torch references of the same ops."""
from __future__ import annotations

import ctypes
import functools

import torch

from batchjob.kernels.native.build import BuildError, build, default_log

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class NativeScaledMM:
    """quantize_rows / rescale on CPU tensors of fp32 or bf16; the same results as the references, bitwise."""

    def __init__(self, lib: ctypes.CDLL):
        self._quantize = lib.bj_quantize_rows_int8
        self._quantize.argtypes, self._quantize.restype = [_P, _I64, _I, _I, _I, _P, _P, _I], _I
        self._rescale = lib.bj_rescale_rows
        self._rescale.argtypes, self._rescale.restype = [_P, _I, _I, _I, _P, _P, _P, _P, _I, _I], _I

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


@functools.cache
def native_scaled_mm() -> NativeScaledMM | None:
    """The compiled ops on this CPU, or None (said once in a log line) where they cannot be built."""
    try:
        return NativeScaledMM(ctypes.CDLL(str(build("scaled_mm.cpp", {}, log=default_log))))
    except (BuildError, OSError) as e:
        default_log(f"int8 matmul: native quantize/rescale unavailable ({e}); using the torch references")
        return None
