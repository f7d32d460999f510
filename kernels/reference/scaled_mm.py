"""Scaled matmuls on quantized operands: the torch references that the native CPU kernels and the Triton
kernels must equal. W8A8: weights symmetric per output channel, activations symmetric per row (token),
quantized at run time, so a row's scale depends on that row alone."""
from __future__ import annotations
import torch

INT8_MAX = 127.0
FP8_MAX = 448.0  # float8_e4m3fn

def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q int8 [M, K], scale fp32 [M, 1]): scale = amax/127 per row (1 for an
    all-zero row), q = round-half-even(x * (127 / amax)) clamped to [-127, 127], computed in fp32."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, INT8_MAX / amax, torch.ones_like(amax))
    q = torch.round(xf * inv).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    return q, scale

def quantize_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scale fp32 [N]): per output channel, the same rule as the rows."""
    q, scale = quantize_rows_int8(w)
    return q, scale.squeeze(1)

def int8_scaled_mm(xq, x_scale, wq, w_scale, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """(xq [M,K] int8 @ wq [N,K].T) in exact int32, then acc * x_scale[M,1] * w_scale[N] (+ bias) in fp32,
    then cast to out_dtype."""
    acc = int8_matmul_int32(xq, wq)
    out = acc.float() * x_scale * w_scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)

def int8_matmul_int32(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """Exact int32 xq @ wq.T (float64 products are exact for K * 127 * 127 < 2**53)."""
    return (xq.double() @ wq.double().T).to(torch.int32)

def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn codes [M, K], scale fp32 [M, 1]): scale = amax/448 per row (1 for an all-zero
    row), codes = x * (448 / amax) clamped to [-448, 448], cast (round to nearest even), in fp32."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
    q = (xf * inv).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return q, scale

def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn codes [N, K], scale fp32 [N]): per output channel, the rows' rule (scale =
    amax / 448, 1 for an all-zero channel), as vLLM's per-channel fp8 weight quantization (symmetric, amax / 448)."""
    q, scale = quantize_rows_fp8(w)
    return q, scale.squeeze(1)

def fp8_scaled_mm(xq, x_scale, wq, w_scale, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """(xq [M,K] e4m3 @ wq [N,K].T) summed in fp32 (float64 here: a GPU's fp32 order differs, within fp32
    rounding), then acc * x_scale[M,1] * w_scale[N] (+ bias) in fp32, then cast to out_dtype."""
    acc = (xq.double() @ wq.double().T).float()
    out = acc * x_scale * w_scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
