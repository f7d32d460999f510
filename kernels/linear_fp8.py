"""W8A8 fp8 weight matmuls (`--quantization fp8`, CUDA with compute capability >= 8.9): `y = (quant(x) @ Wq.T)
* x_scale * w_scale (+ b)` with float8 e4m3 codes, the weight quantized once at load (symmetric, one fp32 scale
per output channel, amax / 448) or a checkpoint's codes as stored, the activations per row at run time
(dynamic), the sums in fp32. The semantics are kernels/reference/scaled_mm.py's `quantize_rows_fp8` and
`fp8_scaled_mm`; kernels/linear_int8.py's `Int8Linear` is the same shape in int8.

On CUDA the Triton kernels (kernels/triton/scaled_mm.py) run, after their start-up check against the
references (kernels/triton/check.py `check_scaled_mm_fp8`); elsewhere the torch references, with one log line.
A CPU never gets here through the job: `check_quantization` refuses fp8 off CUDA (int8 is the CPU form). The
tests build fp8 models on the CPU on the references, and run the Triton kernels under the interpreter.

Nothing here has run on a GPU yet: it is verified under the Triton interpreter only, and neither measured nor
tuned. `torch._scaled_mm` (cuBLASLt / CUTLASS fp8 with row-wise scales) is not used: which output dtypes,
shapes and GPUs its row-wise form accepts has changed between torch versions, and nothing here could check
it; the Triton kernel is the one the tests cover. Whether it is faster is a measurement for a GPU.
"""
from __future__ import annotations

import functools
import logging
from typing import Protocol

import torch

from batchjob.kernels.linear_int8 import scaled_mm_backend
from batchjob.kernels.reference import scaled_mm as reference
from batchjob.kernels.reference.scaled_mm import quantize_weight_fp8

log = logging.getLogger(__name__)


class Fp8Backend(Protocol):
    """What runs an Fp8Linear: the reference module's two functions, with their signatures and semantics (the
    Triton module kernels/triton/scaled_mm.py, or kernels/reference/scaled_mm.py itself)."""

    def quantize_rows_fp8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def fp8_scaled_mm(self, xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor: ...


@functools.cache
def _backend(device: torch.device) -> Fp8Backend:
    """What computes on `device`: on CUDA kernels/linear_int8.py's `scaled_mm_backend` (the Triton module once its
    fp8 start-up check passed, else the references); elsewhere the torch references, with one log line."""
    if device.type != "cuda":
        log.warning("fp8 on %s: no fp8 kernels here (fp8 is the GPU form; a CPU runs --quantization int8); running "
                    "the torch references", device)
        return reference
    return scaled_mm_backend(device, "fp8")


class Fp8Linear:
    """One float8_e4m3fn weight matrix [out, in] with fp32 per-output-channel scales (and an optional bias [out]),
    callable on x [..., in] -> [..., out] in x's dtype."""

    __slots__ = ("codes", "scales", "bias", "out_features", "backend")

    def __init__(self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                 codes: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                 backend: Fp8Backend | None = None):
        """From a float `weight` (quantized here, `quantize_weight_fp8`), or from float8_e4m3fn `codes` [out, in]
        and their fp32 `scales`: [out], or one per-tensor scale ([] or [1]: a checkpoint's), broadcast to every
        channel. `backend`: what computes (default: `_backend` of the codes' device; the tests pass the Triton
        module to run it under the interpreter)."""
        if (weight is None) == (codes is None):
            raise ValueError("Fp8Linear: give either a float weight or float8_e4m3fn codes and their scales")
        if weight is not None:
            codes, scales = quantize_weight_fp8(weight)
        elif scales is None or codes.dtype != torch.float8_e4m3fn or codes.dim() != 2:
            raise ValueError("Fp8Linear: codes must be float8_e4m3fn [out, in] with fp32 scales [out] (or one scale)")
        if scales.numel() == 1:
            scales = scales.reshape(1).expand(codes.shape[0])  # a per-tensor scale: the same for every channel
        if scales.shape != (codes.shape[0],):
            raise ValueError(f"Fp8Linear: {tuple(scales.shape)} scales for {codes.shape[0]} output channels")
        self.codes = codes.contiguous()
        self.scales = scales.float().contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features = codes.shape[0]
        self.backend = backend if backend is not None else _backend(codes.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        xq, xs = self.backend.quantize_rows_fp8(x)
        return self.backend.fp8_scaled_mm(xq, xs, self.codes, self.scales, self.bias, x.dtype)

    def memory(self) -> dict[str, int]:
        """Bytes in memory per format: the e4m3 codes, scales and bias."""
        held = [t for t in (self.codes, self.scales, self.bias) if t is not None]
        return {"fp8": sum(t.numel() * t.element_size() for t in held)}

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch reference of `self(x)` for tests: fp8_scaled_mm of the reference quantization."""
        xq, xs = reference.quantize_rows_fp8(x.reshape(-1, x.shape[-1]))
        out = reference.fp8_scaled_mm(xq, xs, self.codes, self.scales, self.bias, x.dtype)
        return out.view(*x.shape[:-1], self.out_features)
