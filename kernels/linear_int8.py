"""W8A8 int8 weight matmuls (`--quantization int8`): `y = dequant(quant(x) @ Wq.T) + b`, the weight quantized
once at load (symmetric, per output channel), the activations per row at run time (dynamic), so a row's
scale depends on that row alone. The semantics are kernels/reference/scaled_mm.py's `int8_scaled_mm`.

On the CPU a call is one native op wherever the native library builds (any x86 CPU, and Arm through the generic
path), kernels/native/csrc/scaled_mm.cpp `bj_int8_linear`: the rows quantized per row (bitwise the reference),
the integer GEMM over the weight packed once at load (blocks of 64 columns x k in quads, the same on every path),
the rescale `(acc * x_scale) * w_scale (+ bias)` from registers in the reference's order. So a call equals the
reference bitwise. The GEMM's micro-kernel is the built path's (`Int8Linear.kernel` names it):

- `native-avx512-vnni`: `vpdpbusd` on zmm (AMD Zen 4+, Intel Ice Lake+). Measured on the 2-core Zen 4
  development machine, SmolLM2's shapes, weights from memory as in a step (docs/design/int8-matmul.md; `python -m
  batchjob.bench.int8_matmul` repeats them): 3.1-3.4x faster than the bf16 `Linear` at 1 row, 1.9-2.4x at 64 rows,
  1.7-2.0x at 256;
- `native-avx-vnni`: `vpdpbusd` on ymm (AVX2 CPUs with AVX-VNNI: Intel Alder Lake+, AMD Zen 5);
- `native-avx2`: `vpmaddubsw` + `vpmaddwd` on |q| and the weight's bytes flipped by q's sign, exact (AMD Zen 2/3,
  Intel Haswell to Comet Lake, AVX-512 CPUs without VNNI). Measured on the 2-core AMD EPYC Milan (Zen 3) machine,
  SmolLM2's shapes, fp32 in and out, weights from memory, 2 threads: 240-280 GOP/s at 64-256 rows, 1.75-2.7x
  fp32 `F.linear` (1.75-2.3x oneDNN's packed fp32), 3.1-6x at 16 rows, 3.9-6.9x at one row (there memory-bound: a
  quarter of fp32's bytes);
- `native-generic`: plain integer loops (Arm, or BATCHJOB_CPU_ISA=generic); exact, slow.

oneDNN's int8 inner product takes 0.4-0.5 s for a 64-row QKV on Zen 4 (and was only 10-30% faster than AMX bf16 on
a Sapphire Rapids one); `torch._int_mm` reorders the weight on every call (1.2-2.6x slower than ours at 1-64 rows on
Zen 4; 1-2 GOP/s on Zen 3, where it made `--quantization int8` slower than fp32 before the AVX2 kernel).

Batch invariance comes free: integer sums are exact in any order, and the quantize and rescale see one row at a
time. No row tiling is needed (the bf16 Linear runs AMX in calls of 64 rows for this, kernels/linear.py).

Where the native library is not built (no compiler), `_int_mm` runs between the torch references' quantize and
rescale (or the reference GEMM where `_int_mm` is missing or inexact): slower, equal.
On CUDA the Triton kernels (kernels/triton/scaled_mm.py) plug in at `scaled_mm_backend`, after their start-up check.
"""
from __future__ import annotations

import functools
import logging

import torch

from batchjob.kernels.dispatch import KernelError
from batchjob.kernels.modes import Quantization
from batchjob.kernels.native.scaled_mm import PackedInt8, native_scaled_mm
from batchjob.kernels.reference import scaled_mm as reference_scaled_mm
from batchjob.kernels.reference.scaled_mm import int8_matmul_int32, int8_scaled_mm, quantize_rows_int8, quantize_weight_int8


class QuantizationError(KernelError):
    """A quantized compute mode cannot run here; the message says why and what to use instead (a KernelError:
    the CLI and the API report it as they report kernels that cannot run)."""


@functools.cache
def _int_mm_exact() -> bool:
    """Whether this torch's CPU `_int_mm` (int8 x int8 -> int32) runs and is exact: the GEMM where the native
    library is not built."""
    try:
        a = torch.full((3, 40), 127, dtype=torch.int8)
        return bool((torch._int_mm(a, a.T) == 127 * 127 * 40).all())
    except (RuntimeError, AttributeError):
        return False


@functools.cache
def scaled_mm_backend(device: torch.device, quantization: str):
    """The one place where W8A8 compute on a GPU plugs in (`quantization` int8 | fp8): the Triton module with the
    reference's signatures (kernels/triton/scaled_mm.py), once its start-up check against the references passed
    on this device (kernels/triton/check.py check_scaled_mm / check_scaled_mm_fp8); else the torch references on
    the device (slow but equal), with one log line saying why."""
    try:
        from batchjob.kernels.triton import scaled_mm as triton_scaled_mm
        from batchjob.kernels.triton.check import check_scaled_mm, check_scaled_mm_fp8
    except ImportError:
        raise QuantizationError(f"quantization: {str(quantization)!r} compute on {device.type} needs triton; use "
                                f"--quantization none") from None
    problem = (check_scaled_mm if quantization == Quantization.INT8 else check_scaled_mm_fp8)(device)
    if problem is None:
        return triton_scaled_mm
    logging.getLogger(__name__).warning("%s on %s: %s; running the torch references instead", quantization, device,
                                        problem)
    return reference_scaled_mm


class Int8Linear:
    """One int8 weight matrix [out, in] with fp32 per-output-channel scales (and an optional bias [out]),
    callable on x [..., in] -> [..., out] in x's dtype."""

    __slots__ = ("scales", "bias", "out_features", "kernel", "_packed", "_codes", "_native", "_gpu")

    def __init__(self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                 codes: torch.Tensor | None = None, scales: torch.Tensor | None = None):
        """From a float `weight` (quantized here, `quantize_weight_int8`), or from int8 `codes` [out, in] and their
        fp32 `scales` [out] (a checkpoint quantized already)."""
        if (weight is None) == (codes is None):
            raise ValueError("Int8Linear: give either a float weight or int8 codes and their scales")
        native = native_scaled_mm() if (weight if weight is not None else codes).device.type == "cpu" else None
        if weight is not None:
            if native is not None and native.supports(weight.dtype):  # the same codes, in one pass per row
                codes, scales = native.quantize_rows(weight)
                scales = scales.squeeze(1)
            else:
                codes, scales = quantize_weight_int8(weight)
        elif scales is None or codes.dtype != torch.int8 or scales.shape != (codes.shape[0],):
            raise ValueError("Int8Linear: codes must be int8 [out, in] with fp32 scales [out]")
        self.out_features = codes.shape[0]
        self.scales = scales.float().contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self._native = native
        self._packed: PackedInt8 | None = native.pack_weight(codes) if native is not None and native.has_gemm else None
        self._gpu = scaled_mm_backend(codes.device, "int8") if codes.device.type != "cpu" else None
        # the packed copy is what runs; the plain codes stay only where nothing packed them
        self._codes = codes.contiguous() if self._packed is None else None
        # what runs a call, for logs and tests: native-<micro-kernel> (native-avx512-vnni, native-avx-vnni,
        # native-avx2, native-generic) | int_mm | reference | triton
        if self._gpu is not None:
            self.kernel = "reference" if self._gpu is reference_scaled_mm else "triton"
        elif self._packed is not None:
            self.kernel = f"native-{native.gemm_kernel}"
        else:
            self.kernel = "int_mm" if _int_mm_exact() else "reference"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        if self._gpu is not None:
            xq, xs = self._gpu.quantize_rows_int8(x)
            return self._gpu.int8_scaled_mm(xq, xs, self._codes, self.scales, self.bias, x.dtype)
        native = self._native if self._native is not None and self._native.supports(x.dtype) else None
        if native and self._packed is not None:  # the whole call in one native op
            return native.int8_linear(x, self._packed, self.scales, self.bias, x.dtype)
        xq, xs = native.quantize_rows(x) if native else quantize_rows_int8(x)
        acc = self.sums(xq)
        if native:
            return native.rescale(acc, xs, self.scales, self.bias, x.dtype)
        out = acc.float() * xs * self.scales
        return (out if self.bias is None else out + self.bias).to(x.dtype)

    def sums(self, xq: torch.Tensor) -> torch.Tensor:
        """xq [M, in] int8 @ codes.T: the exact int32 sums."""
        if self._packed is not None:
            return self._native.int8_sums(xq, self._packed)
        if self._codes.device.type == "cpu" and _int_mm_exact():
            return torch._int_mm(xq.contiguous(), self._codes.T)
        return int8_matmul_int32(xq, self._codes)

    def memory(self) -> dict[str, int]:
        """Bytes in memory per format: the int8 codes (packed, or plain), scales and bias."""
        held = [t for t in (self.scales, self.bias, self._codes) if t is not None]
        if self._packed is not None:
            held += [self._packed.data, self._packed.corr]
        return {"int8": sum(t.numel() * t.element_size() for t in held)}

    def weight_codes(self) -> torch.Tensor:
        """The int8 weight [out, in] (unpacked from the packed copy where only that is kept)."""
        return self._packed.codes() if self._packed is not None else self._codes

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch reference of `self(x)` for tests: int8_scaled_mm of the reference quantization."""
        xq, xs = quantize_rows_int8(x.reshape(-1, x.shape[-1]))
        out = int8_scaled_mm(xq, xs, self.weight_codes(), self.scales, self.bias, x.dtype)
        return out.view(*x.shape[:-1], self.out_features)
