"""W4A16 weight matmuls on group-wise int4 weights (kernels/linear_w4a16.py): the packed layout, and the torch
reference that kernels/triton/w4a16.py must equal (tests/kernels/w4a16_cases.py, checked at start-up by
kernels/triton/check.py `check_w4a16`).

Layout (GPTQ's): the codes of a weight [n, k] are packed along k, 8 to an int32, into `qweight` [ceil(k / 8), n]:
word (j, c) holds column c's codes for k = 8j .. 8j + 7, code 8j + i in bits 4i .. 4i + 3 (a k past the weight's
end has code 0). Scales (and mins) are transposed to [k / group, n] fp32, so a tile of n is one contiguous load.
A weight's value is scales * (u - 8) (symmetric, no mins) or scales * u + mins, as linear_quant.Int4Weight says."""
from __future__ import annotations

import torch

PACK = 8  # codes per int32 word


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """Codes u [n, k] (uint8, 0..15) -> qweight int32 [ceil(k / 8), n] (the module docstring's layout)."""
    n, k = u.shape
    packed = torch.zeros(n, -(-k // PACK), dtype=torch.int32, device=u.device)
    for i in range(PACK):  # temporaries of half the codes' bytes (not an int [n, k] copy: GBs for an LM head)
        part = u[:, i::PACK]
        packed[:, :part.shape[1]] |= part.to(torch.int32) << (4 * i)  # code 7's top bit is the sign bit: same bits
    return packed.T.contiguous()


def unpack_int4(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """qweight int32 [ceil(k / 8), n] -> codes [k, n] (int64, 0..15): the inverse of pack_int4, transposed."""
    shifts = 4 * torch.arange(PACK, dtype=torch.int64, device=qweight.device)
    codes = (qweight.to(torch.int64)[:, None, :] >> shifts[None, :, None]) & 0xF
    return codes.reshape(-1, qweight.shape[1])[:k]


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int) -> torch.Tensor:
    """The weight's values, transposed: W.T [k, n] fp32 (k = scales.shape[0] * group)."""
    k = scales.shape[0] * group
    u = unpack_int4(qweight, k).float()
    s = scales.float().repeat_interleave(group, dim=0)
    if mins is None:
        return s * (u - 8)
    return s * u + mins.float().repeat_interleave(group, dim=0)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, k] (any float dtype) @ W.T (+ bias) -> [M, n] in x's dtype: W dequantized in fp32 (`dequantize`), the
    product and the bias in fp32, one cast at the end."""
    out = x.float() @ dequantize(qweight, scales, mins, group)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
