"""What a model's weight matmuls are built as at load (`--quantization none|int8|fp8`): the one switch
between kernels/linear.py's `Linear` (the compute dtype) and kernels/linear_int8.py's `Int8Linear` (W8A8).

The families call `linear(weight, bias)` for every projection and stay unaware of quantization;
`build_model` sets the format for the duration of one build (`weight_matmuls(...)`, a context variable, so
two models built in turn, e.g. a target and its draft, each get their own). Kept in the compute dtype under
int8: embeddings, norms and MoE routers (small, and routing is sensitive to them).

The LM head is int8 too. Measured on SmolLM2 (bench/int8_quality.py, 64 prompts): it adds nothing measurable
to the body's quantization error (perplexity 29.71 with it, 29.81 without, bf16 28.51; mean |logit error|
0.558 vs 0.544), and it is 1.6-1.7x faster than bf16 at 1-8 rows, as fast at 64 (bench/int8_matmul.py),
with half the memory.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from batchjob.kernels.linear import Linear
from batchjob.kernels.linear_int8 import Int8Linear, QuantizationError

QUANTIZATIONS = ("none", "int8", "fp8")
WeightMatmul = Linear | Int8Linear  # what a layer calls for a projection: x [..., in] -> [..., out]


@dataclass(frozen=True, slots=True)
class MatmulFormat:
    quantization: str = "none"  # none | int8 (fp8 never gets this far: check_quantization refuses it)
    lm_head: bool = True  # the LM head quantized too (as shipped; off: bench/int8_quality.py's comparison)


_format: ContextVar[MatmulFormat] = ContextVar("matmul_format", default=MatmulFormat())


def check_quantization(quantization: str, device: torch.device | str) -> None:
    """Raises QuantizationError, naming the option and what to use, when `quantization` cannot run on `device`."""
    device = torch.device(device)
    if quantization not in QUANTIZATIONS:
        raise QuantizationError(f"quantization: {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    if quantization == "fp8":
        if device.type != "cuda":
            raise QuantizationError("quantization: 'fp8' compute needs a GPU with fp8 (CUDA compute capability >= 8.9); "
                                    "on the CPU use --quantization int8")
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise QuantizationError(f"quantization: 'fp8' compute needs CUDA compute capability >= 8.9, this GPU has "
                                    f"{cap[0]}.{cap[1]}; use --quantization int8 or none")
        raise QuantizationError("quantization: 'fp8' compute is not implemented yet; use --quantization none")


@contextmanager
def weight_matmuls(quantization: str = "none", lm_head: bool = True) -> Iterator[None]:
    """Within the block, `linear` and `lm_head_linear` build matmuls of this format."""
    token = _format.set(MatmulFormat(quantization, lm_head))
    try:
        yield
    finally:
        _format.reset(token)


def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> WeightMatmul:
    """A projection's weight matmul ([out, in], bias [out]) in the format in force. A fused projection (QKV,
    gate/up) is quantized per output channel as one: the same codes and scales as each part alone."""
    if _format.get().quantization == "int8":
        return Int8Linear(weight, bias)
    return Linear(weight, bias)


def lm_head_linear(weight: torch.Tensor) -> WeightMatmul:
    """The LM head's matmul: the compute dtype unless the format quantizes the LM head too."""
    fmt = _format.get()
    if fmt.quantization == "int8" and fmt.lm_head:
        return Int8Linear(weight)
    return Linear(weight)
