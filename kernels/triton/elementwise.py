"""Triton element-wise kernels: RMSNorm with the residual add fused, rotary embedding on q/k in place, the gated
MLP activations SiLU(gate) * up and GELU-tanh(gate) * up, and the logit soft-cap. Must equal kernels/reference/
norm.py (rms_norm), kernels/reference/rotary.py (apply_rotary) and kernels/reference/elementwise.py (silu_mul,
gelu_tanh_mul, softcap), with torch's roundings in fp16/bf16."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but the CPU paths do not need it
    triton = None

from batchjob.kernels.triton.attention import pow2

if triton is not None:
    from batchjob.kernels.triton.attention import tanh  # a @triton.jit helper: defined only with triton

    @triton.jit
    def _add_rms_norm_kernel(X, R, W, OUT, stride_x, n, eps, HAS_X: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        m = offs < n
        h = tl.load(R + row * n + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_X:
            h = h + tl.load(X + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
            h = h.to(R.dtype.element_ty)  # the residual is stored, and normed, in its own dtype
            tl.store(R + row * n + offs, h, mask=m)
            h = h.to(tl.float32)
        var = tl.sum(h * h, 0) / n
        normed = (h * (1.0 / tl.sqrt(var + eps))).to(OUT.dtype.element_ty).to(tl.float32)
        w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + row * n + offs, (w * normed).to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _rotary_kernel(X, COS, SIN, POS, stride_t, heads, HALF: tl.constexpr, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
        t = tl.program_id(0)
        pos = tl.load(POS + t)
        hh = tl.arange(0, H_PAD)
        i = tl.arange(0, HALF_PAD)
        m = (hh < heads)[:, None] & (i < HALF)[None, :]
        base = X + t * stride_t + hh[:, None] * (2 * HALF) + i[None, :]
        x1 = tl.load(base, mask=m, other=0.0)
        x2 = tl.load(base + HALF, mask=m, other=0.0)
        dt = x1.dtype
        c1 = tl.load(COS + pos * 2 * HALF + i, mask=i < HALF, other=0.0)[None, :]
        s1 = tl.load(SIN + pos * 2 * HALF + i, mask=i < HALF, other=0.0)[None, :]
        c2 = tl.load(COS + pos * 2 * HALF + HALF + i, mask=i < HALF, other=0.0)[None, :]
        s2 = tl.load(SIN + pos * 2 * HALF + HALF + i, mask=i < HALF, other=0.0)[None, :]
        f = tl.float32
        # torch's order and roundings: q * cos + rotate_half(q) * sin, each op rounded to the dtype
        a = (x1.to(f) * c1.to(f)).to(dt).to(f)
        b = ((-x2.to(f)) * s1.to(f)).to(dt).to(f)
        y1 = (a + b).to(dt)
        a2 = (x2.to(f) * c2.to(f)).to(dt).to(f)
        b2 = (x1.to(f) * s2.to(f)).to(dt).to(f)
        y2 = (a2 + b2).to(dt)
        tl.store(base, y1, mask=m)
        tl.store(base + HALF, y2, mask=m)

    @triton.jit
    def _gated_mul_kernel(GU, OUT, n, GELU: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        g = tl.load(GU + t * 2 * n + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU + t * 2 * n + n + offs, mask=m, other=0.0).to(tl.float32)
        if GELU:  # torch's tanh approximation, in its order: 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))
            act = 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * (g * g * g))))
        else:
            act = g / (1.0 + tl.exp(-g))
        act = act.to(OUT.dtype.element_ty).to(tl.float32)  # the activation is rounded before the product, as in torch
        tl.store(OUT + t * n + offs, (act * u).to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _softcap_kernel(X, OUT, stride_x, n, cap, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(X + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        dt = OUT.dtype.element_ty
        y = tanh((x / cap).to(dt).to(tl.float32)).to(dt).to(tl.float32)  # each torch op rounded to the dtype
        tl.store(OUT + row * n + offs, (y * cap).to(dt), mask=m)


def rms_norm(x, weight, eps):
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.shape[-1]
    _add_rms_norm_kernel[(x.numel() // n,)](x, x, weight, out, 0, n, eps, HAS_X=False, BLOCK=pow2(n))
    return out

def add_rms_norm(x, residual, weight, eps):
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(residual)
    n = residual.shape[-1]
    _add_rms_norm_kernel[(residual.shape[0],)](x, residual, weight, out, x.stride(0), n, eps, HAS_X=True, BLOCK=pow2(n))
    return out

def rotary(q, k, prepared):
    cos, sin, positions = prepared
    for x in (q, k):
        t, heads, d = x.shape
        if x.stride(2) != 1 or x.stride(1) != d:
            raise RuntimeError("Triton rotary needs [T, H, D] with dense heads")
        if t:
            _rotary_kernel[(t,)](x, cos, sin, positions, x.stride(0), heads, HALF=d // 2, H_PAD=pow2(heads),
                                 HALF_PAD=pow2(d // 2))
    return q, k

def silu_mul(gate_up):
    return _gated_mul(gate_up, gelu=False)

def gelu_tanh_mul(gate_up):
    return _gated_mul(gate_up, gelu=True)

def _gated_mul(gate_up, gelu: bool):
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * n) if n else 0
    out = torch.empty((*gate_up.shape[:-1], n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, pow2(n))
    if rows:
        _gated_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, GELU=gelu, BLOCK=block)
    return out

def softcap(x, cap):
    """tanh(x / cap) * cap over the last dim, a new tensor in x's dtype (x itself is left as it is)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n) if n else x  # a view where it can be
    if n and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = min(1024, pow2(n))
    if x.numel():
        _softcap_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, x2.stride(0), n, float(cap), BLOCK=block)
    return out
