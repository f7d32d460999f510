"""The torch reference of the matmul on block-quantized weights (kernels/native/csrc/quant_blocks.cpp, computed as
stored): the activations quantized per block of each row (32 values, llama.cpp's Q8_0, for most formats; 256, its
Q8_K, for the K-quants), each block's exact integer dot with the weight's codes, scaled by the block's activation
scale and the weight's fp32 values. Here in float64 from the dequantized weights, the test oracle a kernel result is
held against (within fp32 rounding)."""
from __future__ import annotations

import torch

BLOCK = 32  # activation values per int8 block
INT8_MAX = 127.0


def quantize_blocks_int8(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of `block`) -> (q int8 [M, K], scale fp32 [M, K / block]): per block of a row,
    scale = amax / 127 (1 for an all-zero block), q = round-half-even(x * ((1 / amax) * 127)) in fp32, clamped to
    [-127, 127] (the kernel's own operations and order)."""
    m, k = x.shape
    xf = x.float().reshape(m, k // block, block)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, (1.0 / amax) * INT8_MAX, torch.ones_like(amax))
    q = torch.round(xf * inv).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    return q.reshape(m, k), scale.reshape(m, k // block)


def block_quant_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                       block: int = BLOCK) -> torch.Tensor:
    """x [M, K] @ w [N, K].T with x quantized per `block` values (quantize_blocks_int8) and w the weight's exact values
    (the packed weight dequantized, fp32): sum over blocks of scale * (q_block . w_block), in float64."""
    q, scale = quantize_blocks_int8(x, block)
    m, k = x.shape
    qd = q.double().reshape(m, k // block, block)
    wd = w.double().reshape(w.shape[0], k // block, block)
    out = torch.einsum("mbk,nbk,mb->mn", qd, wd, scale.double())
    return out if bias is None else out + bias.double()
