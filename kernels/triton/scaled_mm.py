"""Triton W8A8 scaled matmuls for CUDA (kernels/linear_int8.py `scaled_mm_backend`): `quantize_rows_int8` and
`int8_scaled_mm` with the signatures and semantics of kernels/reference/scaled_mm.py, which they must equal:
codes and scales bitwise (the reference computes 127 / amax as (1 / amax) * 127, and rounds half to even), the
int32 sums exactly, the rescale (acc * x_scale) * w_scale (+ bias) in fp32 in that order (fp fusion off, so no
FMA changes a rounding). fp8 (e4m3 codes, fp32 sums): `quantize_rows_fp8` and `fp8_scaled_mm`, against
`quantize_rows_fp8` / `fp8_scaled_mm` of the reference. Tested by tests/kernels/triton_cases.py (interpreter and
CUDA) and checked at start-up by kernels/triton/check.py `check_scaled_mm`."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but the CPU paths do not need it
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64
_ROW_BLOCK = 1024  # quantization reads a row in pieces of this many values
_NO_FUSION = {"enable_fp_fusion": False}

if triton is not None:

    @triton.jit
    def _round_half_even(y):
        r = tl.floor(y + 0.5)
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0
        return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)

    @triton.jit
    def _quantize_rows(X, Q, S, K, stride_x, QMAX: tl.constexpr, INT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        k = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            x = tl.load(X + row * stride_x + start + k, mask=start + k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        a = tl.max(amax, 0)
        inv = tl.where(a > 0, tl.math.div_rn(1.0, tl.where(a > 0, a, 1.0)) * QMAX, 1.0)
        for start in range(0, K, BLOCK):
            m = start + k < K
            y = tl.load(X + row * stride_x + start + k, mask=m, other=0.0).to(tl.float32) * inv
            if INT:
                q = tl.minimum(tl.maximum(_round_half_even(y), -QMAX), QMAX).to(tl.int8)
            else:
                q = tl.minimum(tl.maximum(y, -QMAX), QMAX).to(Q.dtype.element_ty)
            tl.store(Q + row * K + start + k, q, mask=m)
        tl.store(S + row, tl.where(a > 0, tl.math.div_rn(a, QMAX), 1.0))

    @triton.jit
    def _scaled_mm(XQ, XS, WQ, WS, B, OUT, M, N, K, HAS_BIAS: tl.constexpr, INT: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], dtype=tl.int32 if INT else tl.float32)
        for start in range(0, K, BK):
            km = start + rk < K
            a = tl.load(XQ + rm[:, None] * K + start + rk[None, :], mask=(rm[:, None] < M) & km[None, :], other=0.0)
            b = tl.load(WQ + rn[None, :] * K + start + rk[:, None], mask=(rn[None, :] < N) & km[:, None], other=0.0)
            acc += tl.dot(a, b, out_dtype=tl.int32 if INT else tl.float32)
        xs = tl.load(XS + rm, mask=rm < M, other=0.0)
        ws = tl.load(WS + rn, mask=rn < N, other=0.0)
        out = acc.to(tl.float32) * xs[:, None] * ws[None, :]
        if HAS_BIAS:
            out = out + tl.load(B + rn, mask=rn < N, other=0.0)[None, :]
        tl.store(OUT + rm[:, None] * N + rn[None, :], out.to(OUT.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _quantize(x: torch.Tensor, qmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    M, K = x.shape
    q = torch.empty((M, K), dtype=dtype, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        _quantize_rows[(M,)](x, q, s, K, x.stride(0), QMAX=qmax, INT=dtype == torch.int8,
                             BLOCK=min(_ROW_BLOCK, triton.next_power_of_2(K)), **_NO_FUSION)
    return q, s


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 codes [M, K], fp32 scales [M, 1]): kernels/reference/scaled_mm.py's, bitwise."""
    return _quantize(x, 127.0, torch.int8)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn codes, fp32 scales [M, 1]): the reference's quantize_rows_fp8."""
    return _quantize(x, 448.0, torch.float8_e4m3fn)


def _mm(xq, x_scale, wq, w_scale, bias, out_dtype) -> torch.Tensor:
    M, K = xq.shape
    N = wq.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    if M and N:
        b = bias.float().contiguous() if bias is not None else w_scale
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
        _scaled_mm[grid](xq.contiguous(), x_scale.float().contiguous(), wq.contiguous(), w_scale.float().contiguous(), b,
                         out, M, N, K, HAS_BIAS=bias is not None, INT=xq.dtype == torch.int8, BM=BLOCK_M, BN=BLOCK_N,
                         BK=BLOCK_K, **_NO_FUSION)
    return out


def int8_scaled_mm(xq, x_scale, wq, w_scale, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """(xq [M, K] int8 @ wq [N, K].T) in exact int32, then acc * x_scale [M, 1] * w_scale [N] (+ bias) in fp32,
    cast to out_dtype: the reference's int8_scaled_mm."""
    return _mm(xq, x_scale, wq, w_scale, bias, out_dtype)


def fp8_scaled_mm(xq, x_scale, wq, w_scale, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """e4m3 codes, fp32 sums (in the GPU's order: equal to the reference within fp32 rounding), then the
    int8 path's rescale."""
    return _mm(xq, x_scale, wq, w_scale, bias, out_dtype)
