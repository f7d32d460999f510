"""Triton W4A16 matmul for CUDA (kernels/linear_w4a16.py): `w4a16_matmul` with the signature and semantics of
kernels/reference/w4a16.py, which it must equal within the rounding of the weights to the activations' dtype
(tests/kernels/w4a16_cases.py, under the interpreter and on CUDA; checked at start-up by kernels/triton/check.py
`check_w4a16`). vLLM's AWQ and GPTQ Triton kernels are the model.

A tiled GEMM, one program per [BLOCK_M, BLOCK_N] tile of the output, looping over k in BLOCK_K steps: it loads the
activations' tile, the [BLOCK_K / 8, BLOCK_N] int32 words of the packed weights (each word read once), unpacks them
into the [BLOCK_K, BLOCK_N] codes with shifts by 0, 4, ..., 28 and a mask, loads the group's scales (and mins) for
the tile, forms scales * (u - 8) (or scales * u + mins) in fp32, casts it to the activations' dtype and adds tl.dot
of the two tiles to an fp32 accumulator; fp32 activations take an fp32 dot (`ieee`, not tf32). Bias in fp32, one
cast at the store. BLOCK_K divides the group (64, 32 or 16) so a tile's scales are one row of the scales; a group
that is not a multiple of 16 takes BLOCK_K 32 and a group index per row of k. Compiled ahead of time here (no GPU)
for sm_80 and sm_90, fp16, bf16 and fp32, groups 128, 32, 16 and 8: mma.sync for fp16/bf16, 5-17 KB of shared memory
(fp32 10-37 KB; groups below 16 41-51 KB), within every CUDA GPU's 99 KB; not yet run or timed on a GPU.

Batch invariance: the tiles are fixed (BLOCK_M, BLOCK_N, BLOCK_K, warps and stages depend on the weight's group
alone, never on M; M is not specialized on, so every row count runs the same compiled kernel) and each program sums
k in one fixed order with no split-K, so a row's result does not depend on the rows beside it or on their number: a
row alone equals that row in any batch, bitwise. Under the interpreter (TRITON_INTERPRET=1), which computes bf16 on
raw bits, bf16 activations take the fp32 dot (so there a bf16 call checks loads, unpacking and stores, not the GPU's
bf16 dot)."""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but the CPU paths do not need it
    triton = None

BLOCK_M, BLOCK_N = 32, 64
NUM_WARPS = 4


def block_k(group: int) -> int:
    """The k tile for a group size: the largest of 64, 32, 16 dividing it (a tile within one group), else 32 (a group
    index per row of k; a [32, BLOCK_N] tile of scales and of mins fits the shared memory of every GPU's pipeline)."""
    return next((b for b in (64, 32, 16) if group % b == 0), 32)


if triton is not None:

    @triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count
    def _w4a16_kernel(X, Q, S, Z, B, OUT, M, N, K, stride_xm, GROUP: tl.constexpr, HAS_MINS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)  # programs of one column tile run together: its weights stay in L2
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        mm, nm = rm < M, rn < N
        rm = rm.to(tl.int64)  # M x N outputs (an LM head over a long prefill) can pass 2**31
        rw = tl.arange(0, BK // 8)
        shift = (tl.arange(0, 8) * 4)[None, :, None]
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + rk
            km = k < K
            x = tl.load(X + rm[:, None] * stride_xm + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            j = k0 // 8 + rw
            words = tl.load(Q + j[:, None] * N + rn[None, :], mask=(j * 8 < K)[:, None] & nm[None, :], other=0)
            u = tl.reshape((words[:, None, :] >> shift) & 0xF, (BK, BN)).to(tl.float32)  # row 8j + i: code i of word j
            if GROUP % BK == 0:  # the tile lies in one group: one row of scales
                g = (k0 // GROUP) * N + rn[None, :]
                gm = nm[None, :]
            else:
                g = (k // GROUP)[:, None] * N + rn[None, :]
                gm = km[:, None] & nm[None, :]
            s = tl.load(S + g, mask=gm, other=0.0)
            if HAS_MINS:
                w = u * s + tl.load(Z + g, mask=gm, other=0.0)
            else:
                w = (u - 8.0) * s
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(X.dtype.element_ty))
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=nm, other=0.0)[None, :]
        tl.store(OUT + rm[:, None] * N + rn[None, :], acc.to(OUT.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, k] (fp16, bf16 or fp32) @ W.T (+ bias) -> [M, n] in x's dtype; qweight int32 [ceil(k / 8), n], scales
    (and mins) fp32 [k / group, n], bias fp32 [n] (kernels/reference/w4a16.py's layout)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = qweight.shape[1]
    if K != scales.shape[0] * group:
        raise ValueError(f"w4a16: x has {K} inputs, the weight {scales.shape[0] * group}")
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M and N:
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        dot_f32 = x.dtype == torch.float32 or (interpreted and x.dtype == torch.bfloat16)
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
        _w4a16_kernel[grid](x, qweight, scales, scales if mins is None else mins, scales if bias is None else bias, out,
                            M, N, K, x.stride(0), GROUP=group, HAS_MINS=mins is not None, HAS_BIAS=bias is not None,
                            DOT_F32=dot_f32, BM=BLOCK_M, BN=BLOCK_N, BK=block_k(group), num_warps=NUM_WARPS)
    return out
