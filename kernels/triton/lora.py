"""Triton LoRA kernels (issue 37; vLLM's `lora_shrink` / `lora_expand` are the model): per token, the shrink through
its own adapter slot's A, then the expand through its B added to the projection's output; a token of slot -1 is left
as it is. One program per (token, tile of ranks or outputs): a token's sums never depend on the tokens beside it.
Must equal kernels/reference/lora.py (lora_shrink, lora_expand); tested under the interpreter
(tests/kernels/triton_cases.py)."""
from __future__ import annotations

import torch

from batchjob.kernels.triton.attention import pow2, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _shrink_kernel(X, A, S, H, stride_x, stride_h, K, R, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(S + t)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = r < R
        acc = tl.zeros([BLOCK_R], tl.float32)
        if slot >= 0:
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                km = k < K
                xv = tl.load(X + t * stride_x + k, mask=km, other=0.0).to(tl.float32)
                av = tl.load(A + (slot * R + r)[:, None] * K + k[None, :], mask=rm[:, None] & km[None, :],
                             other=0.0).to(tl.float32)
                acc += tl.sum(av * xv[None, :], axis=1)
        tl.store(H + t * stride_h + r, acc.to(H.dtype.element_ty), mask=rm)

    @triton.jit
    def _expand_kernel(H, B, S, Y, stride_h, stride_y, N, R, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(S + t)
        if slot >= 0:
            n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            nm = n < N
            r = tl.arange(0, R_PAD)
            rm = r < R
            hv = tl.load(H + t * stride_h + r, mask=rm, other=0.0).to(tl.float32)
            bv = tl.load(B + (slot * N + n)[:, None] * R + r[None, :], mask=nm[:, None] & rm[None, :],
                         other=0.0).to(tl.float32)
            d = tl.sum(bv * hv[None, :], axis=1)
            yv = tl.load(Y + t * stride_y + n, mask=nm, other=0.0).to(tl.float32)
            tl.store(Y + t * stride_y + n, (yv + d).to(Y.dtype.element_ty), mask=nm)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[T, in] -> [T, R] (x's dtype): x A[slot]^T per token; zero for slot -1."""
    x = x.contiguous()
    t, (_, r, k) = x.shape[0], a.shape
    h = torch.empty(t, r, dtype=x.dtype, device=x.device)
    if t:
        block_r = min(64, pow2(r))
        _shrink_kernel[(t, triton.cdiv(r, block_r))](x, a, slots, h, x.stride(0), h.stride(0), k, r,
                                                     BLOCK_R=block_r, BLOCK_K=min(128, pow2(k)))
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y + h B[slot]^T per token, into y (the base matmul's fresh output) in place."""
    y = y.contiguous()
    t, (_, n, r) = y.shape[0], b.shape
    if t:
        _expand_kernel[(t, triton.cdiv(n, 128))](h, b, slots, y, h.stride(0), y.stride(0), n, r, BLOCK_N=128,
                                                 R_PAD=pow2(r))
    return y
