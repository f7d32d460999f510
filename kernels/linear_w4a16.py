"""W4A16 weight matmuls on CUDA (`--quantization int4` and compressed-tensors W4A16 checkpoints): group-wise int4
weights (kernels/linear_quant.py `Int4Weight`) kept packed on the GPU and dequantized tile by tile inside the
matmul, activations in the compute dtype (kernels/quantization.py `int4_linear` builds it on CUDA).

At load the codes are packed GPTQ-style, 8 to an int32 along k ([ceil(k / 8), n]), and the fp32 scales (and mins)
transposed to [k / group, n] (kernels/reference/w4a16.py owns the layout): a quarter of the bf16 weight's bytes plus
4 bytes per group (8 with mins). A call runs the Triton kernel (kernels/triton/w4a16.py: fixed tiles, no split-K, so
a row's result does not depend on its batch) once its start-up check (kernels/triton/check.py `check_w4a16`) passed
on this device; else the torch reference (dequantize per call, then an fp32 matmul: slow, equal), with one log line
saying why."""
from __future__ import annotations

import functools
import logging
from collections import Counter

import torch

from batchjob.kernels.linear_quant import Int4Weight
from batchjob.kernels.reference import w4a16 as reference_w4a16


@functools.cache
def w4a16_backend(device: torch.device):
    """The module that computes W4A16 on `device`: kernels/triton/w4a16.py once check_w4a16 passed there (once per
    device), else kernels/reference/w4a16.py, with one log line saying why. Both have `w4a16_matmul`."""
    try:
        from batchjob.kernels.triton import w4a16 as triton_w4a16
        from batchjob.kernels.triton.check import check_w4a16
        from batchjob.kernels.triton.ops import available
        problem = available(device)
        if problem is None:
            try:
                problem = check_w4a16(device)
            except Exception as e:  # noqa: BLE001 - a kernel that does not compile or launch here: the reference runs
                problem = f"the Triton kernel failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    except ImportError:
        problem = "triton is not installed"
    if problem is None:
        return triton_w4a16
    logging.getLogger(__name__).warning("int4 (W4A16) on %s: %s; running the torch reference instead (the weights "
                                        "dequantized on every call)", device, problem)
    return reference_w4a16


class W4A16Linear:
    """One group-wise int4 weight [n, k] (and an optional bias [n]), callable on x [..., k] (fp16, bf16 or fp32, on
    the weight's device) -> [..., n] in x's dtype."""

    __slots__ = ("qweight", "scales", "mins", "group", "bias", "out_features", "in_features", "kernel", "_backend")

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None):
        n, k = weight.shape
        if k % weight.group or weight.scales.shape != (n, k // weight.group):
            raise ValueError(f"W4A16Linear: scales {tuple(weight.scales.shape)} do not fit a weight [{n}, {k}] in "
                             f"groups of {weight.group}")
        self.out_features, self.in_features, self.group = n, k, weight.group
        self.qweight = reference_w4a16.pack_int4(weight.u)
        self.scales = weight.scales.float().T.contiguous()
        self.mins = None if weight.mins is None else weight.mins.float().T.contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self._backend = w4a16_backend(weight.u.device)
        self.kernel = "reference" if self._backend is reference_w4a16 else "triton"  # what runs a call, for logs and tests

    @property
    def formats(self) -> Counter[str]:
        """Weights per format name (as BlockQuantLinear.formats)."""
        return Counter({f"int4 g{self.group}": self.out_features * self.in_features})

    @property
    def nbytes(self) -> int:
        """Bytes on the device: packed codes, scales, mins and bias."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins, self.bias) if t is not None)

    def memory(self) -> dict[str, int]:
        """Bytes in memory per format (the start line's weights)."""
        return {f"int4 g{self.group}": self.nbytes}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        return self._backend.w4a16_matmul(x, self.qweight, self.scales, self.mins, self.group, self.bias)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch reference of `self(x)`, for tests."""
        out = reference_w4a16.w4a16_matmul(x.reshape(-1, x.shape[-1]), self.qweight, self.scales, self.mins,
                                           self.group, self.bias)
        return out.view(*x.shape[:-1], self.out_features)
