"""What a model's weight matmuls are built as at load (`--quantization none|int8|fp8`): the one switch
between kernels/linear.py's `Linear` (the compute dtype), kernels/linear_int8.py's `Int8Linear` (W8A8 int8)
and kernels/linear_fp8.py's `Fp8Linear` (W8A8 fp8 e4m3, CUDA with compute capability >= 8.9 only).

The families call `linear(fmt, weight, bias)` for every projection with the format `build_model` hands them
(`BuildSpec.matmuls`, models/family.py), explicit, so two models built in turn, e.g. a target and its draft,
each get their own; the families do not look into it. Kept in the compute dtype under
int8: embeddings, norms and MoE routers (small, and routing is sensitive to them).

The LM head is int8 too. Measured on SmolLM2 (bench/int8_quality.py, 64 prompts): it adds nothing measurable
to the body's quantization error (perplexity 29.71 with it, 29.81 without, bf16 28.51; mean |logit error|
0.558 vs 0.544), and it is 3x faster than bf16 at 1-8 rows, 2x at 64 (bench/int8_matmul.py, AMD Zen 4),
with half the memory.

Under fp8 the LM head stays in the compute dtype, as vLLM keeps it (its fp8 config quantizes linear layers, not
the LM head, and llm-compressor's fp8 recipes list lm_head in `ignore`): nothing measured here says an fp8 head
would be harmless (fp8 has not run on a GPU yet), and the head is the last matmul before sampling.

A pre-quantized checkpoint hands some weights over as `QuantizedWeight`s (codes + scales, as the file stores
them): compressed-tensors W8A8 int8 (models/compressed_tensors.py: its codes and per-channel scales become the
Int8Linear's as they are, and its float weights, the `ignore` list, stay in the compute dtype) and GGUF Q8_0
(models/gguf_file.py: int8 codes with one scale per 32 weights along K, re-quantized per output channel under
int8, dequantized exactly as before otherwise), and compressed-tensors W8A8 fp8 where the device computes fp8
(`keeps_fp8_codes`: the loader is told so; its e4m3 codes and scales become the Fp8Linear's as they are;
elsewhere they are dequantized at load). `resolved_quantization` decides the format such a model runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchjob.kernels.linear import Linear
from batchjob.kernels.linear_fp8 import Fp8Linear
from batchjob.kernels.linear_int8 import Int8Linear, QuantizationError
from batchjob.kernels.linear_quant import BlockQuantLinear, Int4Weight, PackedWeight, quantize_int4
from batchjob.kernels.linear_w4a16 import W4A16Linear
from batchjob.kernels.native.quant_blocks import native_quant_blocks
from batchjob.kernels.reference.scaled_mm import quantize_weight_fp8, quantize_weight_int8
from batchjob.kernels.modes import Quantization

QUANTIZATIONS = tuple(Quantization)
# what a layer calls for a projection: x [..., in] -> [..., out]; each says its memory() per format
WeightMatmul = Linear | Int8Linear | Fp8Linear | BlockQuantLinear | W4A16Linear
FP8_CAPABILITY = (8, 9)  # CUDA compute capability with fp8 tensor cores: Ada (8.9), Hopper (9.0) and later


@dataclass(frozen=True, slots=True)
class MatmulFormat:
    quantization: str = "none"  # none | int8 | fp8 | int4 (fp8 only where check_quantization let it: CUDA, cap >= 8.9)
    lm_head: bool = True  # under int8, the LM head quantized too (as shipped; off: bench/int8_quality.py's
    # comparison); under fp8 it stays in the compute dtype whatever this says (the module docstring)
    prequantized: bool = False  # int8 / fp8 where the checkpoint gave codes; its float weights stay float


@dataclass(slots=True)
class QuantizedWeight:
    """A weight [out, in] as a checkpoint stores it: int8 (or float8_e4m3fn) codes and fp32 scales, one per
    output channel ([out], `group` 0) or one per `group` weights along K ([out, in / group]: GGUF Q8_0's 32).
    Its value is codes * scales, computed in fp32 (as gguf's dequantize and compressed-tensors compute it)."""
    codes: torch.Tensor
    scales: torch.Tensor
    scheme: str  # what the checkpoint calls it, for messages: "compressed-tensors int8", "GGUF Q8_0"
    group: int = 0

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def to(self, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> QuantizedWeight:
        """On `device`; `dtype` (the compute dtype) leaves codes and scales as they are."""
        return QuantizedWeight(self.codes.to(device), self.scales.to(device), self.scheme, self.group)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        scales = self.scales.float()
        scales = scales.repeat_interleave(self.group, dim=1) if self.group else scales[:, None]
        return (self.codes.float() * scales).to(dtype)

    def int8_channel(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 codes [out, in], fp32 scales [out]): the checkpoint's own where it has them (no re-quantization),
        else the per-channel quantization of the exact fp32 values (quantize_weight_int8)."""
        if self.group == 0 and self.codes.dtype == torch.int8:
            return self.codes, self.scales.float()
        return quantize_weight_int8(self.dequantized(torch.float32))

    def fp8_channel(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(float8_e4m3fn codes [out, in], fp32 scales [out]): the checkpoint's own where it has them, else the
        per-channel quantization of the exact fp32 values (quantize_weight_fp8)."""
        if self.group == 0 and self.codes.dtype == torch.float8_e4m3fn:
            return self.codes, self.scales.float()
        return quantize_weight_fp8(self.dequantized(torch.float32))

    @staticmethod
    def cat(parts: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
        """Parts concatenated along the output dim (a fused QKV or gate/up): codes and scales concatenate; parts
        of different kinds (a float part, another group size) are all dequantized to the float parts' dtype."""
        quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
        first = quantized[0]
        if len(quantized) == len(parts) and all(p.group == first.group and p.codes.dtype == first.codes.dtype
                                                for p in quantized):
            return QuantizedWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales.float() for p in parts]),
                                   first.scheme, first.group)
        dtype = next((p.dtype for p in parts if not isinstance(p, QuantizedWeight)), torch.float32)
        return torch.cat([p.dequantized(dtype) if isinstance(p, QuantizedWeight) else p for p in parts])


def fp8_capable(device: torch.device | str) -> bool:
    """Whether `device` computes fp8: CUDA with compute capability >= 8.9."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def keeps_fp8_codes(requested: str, device: torch.device | str) -> bool:
    """For the loader, which is told what the device computes: whether a compressed-tensors W8A8 fp8 checkpoint
    keeps its e4m3 codes (LoadedModel.quantization "fp8": it runs fp8) or is dequantized at load ("dequantized":
    the compute dtype). Kept where `device` computes fp8, unless --quantization none asks for the compute dtype
    (a way around the fp8 kernels, which have not run on a GPU yet); so `--quantization int8` on such a
    checkpoint is refused everywhere (resolved_quantization), naming what it runs as there."""
    return requested != Quantization.NONE and fp8_capable(device)


def resolved_quantization(requested: str, checkpoint: str | None, scheme: str, source: str) -> str:
    """The format a model's weight matmuls run in (none | int8 | fp8): `requested` (--quantization; auto = the
    checkpoint's) against what a pre-quantized checkpoint fixes (`checkpoint`, as LoadedModel.quantization says:
    "int8" runs int8, "fp8" fp8, "dequantized" the compute dtype). As vLLM decides: the checkpoint's
    quantization wins, and an explicit option that conflicts with it is an error, not silently overridden."""
    if checkpoint is None:
        return Quantization.NONE if requested == Quantization.AUTO else Quantization(requested)
    runs = (Quantization(checkpoint) if checkpoint in (Quantization.INT8, Quantization.FP8, Quantization.INT4)
            else Quantization.NONE)
    if requested not in (Quantization.AUTO, runs):
        why = ("" if runs != Quantization.NONE else " here, its weights dequantized at load (fp8 compute needs a CUDA GPU with "
               "compute capability >= 8.9; weight-only compute is not written)")
        raise QuantizationError(f"quantization: {source} is a pre-quantized checkpoint ({scheme}) that runs as "
                                f"{runs.value!r}{why}; --quantization {requested} conflicts with it: use auto (or {runs})")
    return runs


def check_quantization(quantization: str, device: torch.device | str) -> None:
    """Raises QuantizationError, naming the option and what to use, when `quantization` cannot run on `device`."""
    device = torch.device(device)
    if quantization not in QUANTIZATIONS[1:]:  # auto is resolved before (resolved_quantization)
        raise QuantizationError(f"quantization: {quantization!r} is not one of {', '.join(QUANTIZATIONS[1:])}")
    if quantization == Quantization.INT4 and device.type not in ("cpu", "cuda"):
        raise QuantizationError(f"quantization: 'int4' runs on CPUs and CUDA GPUs, not {device.type}; use none")
    if quantization == "fp8":
        if device.type != "cuda":
            raise QuantizationError("quantization: 'fp8' compute needs a GPU with fp8 (CUDA compute capability >= 8.9); "
                                    "on the CPU use --quantization int8")
        cap = torch.cuda.get_device_capability(device)
        if cap < FP8_CAPABILITY:
            raise QuantizationError(f"quantization: 'fp8' compute needs CUDA compute capability >= 8.9, this GPU has "
                                    f"{cap[0]}.{cap[1]}; use --quantization int8 or none")


def linear(fmt: MatmulFormat, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> WeightMatmul:
    """A projection's weight matmul ([out, in], bias [out]) in the format `fmt` (the model's, given at build). A fused projection (QKV,
    gate/up) is quantized per output channel as one: the same codes and scales as each part alone. A
    QuantizedWeight arrives only under int8 or fp8 (build_model dequantizes them otherwise): its codes as stored
    where they are of that kind, else re-quantized per channel from its exact values. A PackedWeight (GGUF blocks,
    int4 groups: kernels/linear_quant.py) is computed as stored whatever `fmt` says: build_model hands one over only
    where it runs so."""
    if isinstance(weight, PackedWeight):
        return BlockQuantLinear(weight, bias)
    if isinstance(weight, Int4Weight):
        return int4_linear(weight, bias)
    if fmt.quantization == Quantization.INT4 and not fmt.prequantized:
        return int4_linear(quantize_int4(weight), bias)
    if isinstance(weight, QuantizedWeight):
        if fmt.quantization == "fp8":
            codes, scales = weight.fp8_channel()
            return Fp8Linear(bias=bias, codes=codes, scales=scales)
        codes, scales = weight.int8_channel()
        return Int8Linear(bias=bias, codes=codes, scales=scales)
    if fmt.prequantized:
        return Linear(weight, bias)
    if fmt.quantization == "int8":
        return Int8Linear(weight, bias)
    if fmt.quantization == "fp8":
        return Fp8Linear(weight, bias)
    return Linear(weight, bias)


def int4_linear(weight: Int4Weight, bias: torch.Tensor | None = None) -> WeightMatmul:
    """The one place group-wise int4 plugs in: on a CPU packed and computed as stored (BlockQuantLinear; groups that
    are not a multiple of 32 weights are dequantized, said once), on CUDA the Triton W4A16 kernel
    (kernels/linear_w4a16.py, after its start-up check), elsewhere dequantized."""
    device = weight.u.device
    if device.type == "cpu":
        if weight.packable() and native_quant_blocks() is not None:
            return BlockQuantLinear(weight.packed(), bias)
        from batchjob.notices import notice
        why = (f"groups of {weight.group} weights are not computed as stored (the kernel takes multiples of 32)"
               if native_quant_blocks() is not None else "the native kernel cannot be built here (no C++ compiler)")
        notice(f"int4: {why}; such weights are dequantized at load (the compute dtype's memory and speed)")
        return Linear(weight.dequantized(torch.float32 if bias is None else bias.dtype), bias)
    if device.type == "cuda":
        return W4A16Linear(weight, bias)
    return Linear(weight.dequantized(torch.float32), bias)


def lm_head_linear(fmt: MatmulFormat, weight: torch.Tensor | QuantizedWeight) -> WeightMatmul:
    """The LM head's matmul: the compute dtype unless int8 quantizes the LM head too (or the checkpoint did);
    under fp8 the compute dtype (the module docstring says why). A PackedWeight (a GGUF file's LM head, or its tied
    embeddings) is computed as stored."""
    if isinstance(weight, (QuantizedWeight, PackedWeight, Int4Weight)):
        return linear(fmt, weight)
    if fmt.quantization in ("int8", "int4") and fmt.lm_head and not fmt.prequantized:
        return Int8Linear(weight)  # under int4 too: an int8 head (quality: docs/guide/quantization.md)
    return Linear(weight)
