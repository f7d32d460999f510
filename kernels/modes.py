"""The kernel-side modes a job chooses, as `StrEnum`s (plain Python: naming them imports no torch)."""
from __future__ import annotations

from enum import StrEnum


class KernelChoice(StrEnum):
    """`--kernels`: which kernel set a model runs with (dispatch.py)."""
    AUTO = "auto"
    TORCH = "torch"
    NATIVE = "native"
    TRITON = "triton"


class Quantization(StrEnum):
    """`--quantization`: the weight matmuls' format (quantization.py); auto: the checkpoint's (none for a float one)."""
    AUTO = "auto"
    NONE = "none"
    INT8 = "int8"
    FP8 = "fp8"
    INT4 = "int4"  # weight-only, group-wise (linear_quant.py Int4Weight): the CPU's packed kernel, Triton W4A16 on CUDA


class KvCacheDtype(StrEnum):
    """`--kv-cache-dtype`: auto (the compute dtype) or a quantized cache (reference/kv_quant.py)."""
    AUTO = "auto"
    INT8 = "int8"
    INT4 = "int4"
