"""W8A8 int8 weight matmuls (`--quantization int8`): `y = dequant(quant(x) @ Wq.T) + b`, the weight quantized
once at load (symmetric, per output channel), the activations per row at run time (dynamic), so a row's
scale depends on that row alone. The semantics are kernels/reference/scaled_mm.py's `int8_scaled_mm`.

On a CPU, three steps per call (measured on the 2-core Sapphire Rapids development machine, numbers in
docs/design/int8-matmul.md; `python -m batchjob.bench.int8_matmul` repeats them):
1. the rows' quantization: kernels/native/csrc/scaled_mm.cpp (one pass per row; the torch reference's six ops
   cost 40-110 us per call, more than many of SmolLM2's GEMMs);
2. the GEMM: oneDNN's int8 inner product (AMX-int8 here) on a weight packed once at load
   (`onednn.qlinear_prepack`, as inductor's x86 quantization packs it), with unit scales, so it returns the
   int32 sums exactly converted to fp32. oneDNN takes only one activation scale per call, not one per row,
   so the per-row scale is applied after. `torch._int_mm` (oneDNN too) repacks the weight on every call:
   as fast on the small layers, 1.5-2x slower on the LM head;
3. the rescale `(acc * x_scale) * w_scale (+ bias)` into the output dtype: scaled_mm.cpp again, in the
   reference's order, so the result equals the reference bitwise.

Measured per call, weights from memory as in a step, ms for bf16 `Linear` -> Int8Linear: QKV [960x576] at
1 row 0.215 -> 0.155, 64 rows 0.155 -> 0.206, 256 rows 0.766 -> 0.553; gate/up [3072x576] 8 rows
0.587 -> 0.379, 64 rows 0.537 -> 0.584; LM head [49152x576] 1 row 5.60 -> 3.29, 64 rows 5.01 -> 4.98. So
int8 pays at few rows and many, and breaks even at 64 (oneDNN's cold 64-row int8 GEMM is only 10-30%
faster than AMX bf16, and quantize + rescale + Python cost ~25-30 us a call).

Batch invariance comes free: integer sums are exact in any order, so oneDNN's blocking (which changes with
the row count) cannot change a row's result, and the quantize and rescale steps see one row at a time. No
row tiling is needed (the bf16 Linear runs AMX in calls of 64 rows for this, kernels/linear.py).

Where neither oneDNN's int8 kernels nor the native ops exist, the torch references run (slow but equal).
On CUDA the Triton kernels (kernels/triton/scaled_mm.py) plug in at `_gpu_backend`, after their start-up check.
"""
from __future__ import annotations

import functools
import logging

import torch

from batchjob.kernels.dispatch import KernelError
from batchjob.kernels.native.scaled_mm import native_scaled_mm
from batchjob.kernels.reference.scaled_mm import int8_matmul_int32, int8_scaled_mm, quantize_rows_int8, quantize_weight_int8


class QuantizationError(KernelError):
    """A quantized compute mode cannot run here; the message says why and what to use instead (a KernelError:
    the CLI and the API report it as they report kernels that cannot run)."""


@functools.cache
def _onednn_int8() -> bool:
    """Whether this torch has oneDNN's int8 linear (x86 builds with mkldnn)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        q = torch.ones(8, 8, dtype=torch.int8)
        packed = torch.ops.onednn.qlinear_prepack(q, None)
        out = torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, packed, torch.ones(8), torch.zeros(8, dtype=torch.int64),
                                                 None, 1.0, 0, torch.float32, "none", [], "")
        return bool((out == 8).all())
    except (RuntimeError, AttributeError):
        return False


@functools.cache
def _gpu_backend(device: torch.device):
    """The one place where int8 compute on a GPU plugs in: the Triton module with the reference's
    `quantize_rows_int8` and `int8_scaled_mm` signatures (kernels/triton/scaled_mm.py), once its start-up check
    against the references passed on this device (kernels/triton/check.py check_scaled_mm); else the torch
    references on the device (slow but equal), with one log line saying why."""
    try:
        from batchjob.kernels.triton import scaled_mm as triton_scaled_mm
        from batchjob.kernels.triton.check import check_scaled_mm
    except ImportError:
        raise QuantizationError(f"quantization: 'int8' compute on {device.type} needs triton; use --quantization none") from None
    problem = check_scaled_mm(device)
    if problem is None:
        return triton_scaled_mm
    logging.getLogger(__name__).warning("int8 on %s: %s; running the torch references instead", device, problem)
    from batchjob.kernels.reference import scaled_mm as reference

    return reference


class Int8Linear:
    """One int8 weight matrix [out, in] with fp32 per-output-channel scales (and an optional bias [out]),
    callable on x [..., in] -> [..., out] in x's dtype."""

    __slots__ = ("codes", "scales", "bias", "out_features", "packed", "_unit", "_zero", "_native", "_gpu")

    def __init__(self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                 codes: torch.Tensor | None = None, scales: torch.Tensor | None = None):
        """From a float `weight` (quantized here, `quantize_weight_int8`), or from int8 `codes` [out, in] and their
        fp32 `scales` [out] (a checkpoint quantized already)."""
        if (weight is None) == (codes is None):
            raise ValueError("Int8Linear: give either a float weight or int8 codes and their scales")
        if weight is not None:
            codes, scales = quantize_weight_int8(weight)
        elif scales is None or codes.dtype != torch.int8 or scales.shape != (codes.shape[0],):
            raise ValueError("Int8Linear: codes must be int8 [out, in] with fp32 scales [out]")
        self.out_features = codes.shape[0]
        self.scales = scales.float().contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.packed = None
        self._gpu = None
        self._native = None
        if codes.device.type == "cpu":
            self._native = native_scaled_mm()
            if _onednn_int8():
                self.packed = torch.ops.onednn.qlinear_prepack(codes.contiguous(), None)
                self._unit = torch.ones(self.out_features)  # the scales are applied after (see the docstring)
                self._zero = torch.zeros(self.out_features, dtype=torch.int64)
        else:
            self._gpu = _gpu_backend(codes.device)
        # the packed copy is what runs; the plain codes stay only where nothing packed them
        self.codes = codes.contiguous() if self.packed is None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        if self._gpu is not None:
            xq, xs = self._gpu.quantize_rows_int8(x)
            return self._gpu.int8_scaled_mm(xq, xs, self.codes, self.scales, self.bias, x.dtype)
        native = self._native if self._native is not None and self._native.supports(x.dtype) else None
        xq, xs = native.quantize_rows(x) if native else quantize_rows_int8(x)
        acc = self.sums(xq)
        if native:
            return native.rescale(acc, xs, self.scales, self.bias, x.dtype)
        out = acc.float() * xs * self.scales
        return (out if self.bias is None else out + self.bias).to(x.dtype)

    def sums(self, xq: torch.Tensor) -> torch.Tensor:
        """xq [M, in] int8 @ codes.T: the exact int32 sums (as fp32 values where oneDNN computes them: fp32
        of the int32 sum, the conversion the reference's rescale does)."""
        if self.packed is not None:
            return torch.ops.onednn.qlinear_pointwise(xq.contiguous(), 1.0, 0, self.packed, self._unit, self._zero, None,
                                                      1.0, 0, torch.float32, "none", [], "")
        return int8_matmul_int32(xq, self.codes)

    def weight_codes(self) -> torch.Tensor:
        """The int8 weight [out, in] (from the packed copy where only that is kept: the sums of unit rows)."""
        if self.codes is not None:
            return self.codes
        return self.sums(torch.eye(self.packed.shape[0], dtype=torch.int8)).T.round().to(torch.int8).contiguous()

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch reference of `self(x)` for tests: int8_scaled_mm of the reference quantization."""
        xq, xs = quantize_rows_int8(x.reshape(-1, x.shape[-1]))
        out = int8_scaled_mm(xq, xs, self.weight_codes(), self.scales, self.bias, x.dtype)
        return out.view(*x.shape[:-1], self.out_features)
