"""The Triton W4A16 kernel (kernels/triton/w4a16.py) against its torch reference (kernels/reference/w4a16.py), run by
tests/kernels/test_w4a16.py under the interpreter in a process of its own (TRITON_INTERPRET=1 must be set before
anything imports triton), and on a GPU by `make gpu-check` (batchjob/bench/gpu_check.py):

    TRITON_INTERPRET=1 python -m tests.kernels.w4a16_cases [--device cpu|cuda] [-k NAME]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from batchjob.kernels.triton.check import W4A16_TOLERANCE

# (group, mins, n, k): symmetric and with mins; groups of 32 and 128 (a k tile of one group), 16 (the smallest
# tile), 8 and 4 (several groups per tile: a group index per row of k; k 36 ends inside a packed word); k not a
# multiple of 64 where the group allows; n not a multiple of the column tile
MATMUL = [(32, False, 96, 160), (32, True, 70, 96), (128, False, 80, 256), (128, True, 64, 384), (16, True, 64, 48),
          (8, False, 70, 40), (4, True, 33, 36)]
ROWS = (1, 5, 33)  # a decode row, a few, more than one row tile
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def int4_operands(group, with_mins, n, k, device, seed):
    """(codes u [n, k] uint8, scales and mins fp32 [n, k / group]: the Int4Weight's, on `device`)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    mins = -scales * torch.randint(0, 16, scales.shape, generator=g) if with_mins else None  # an asymmetric zero point
    return u.to(device), scales.to(device), None if mins is None else mins.to(device)


def _packed(u, scales, mins):
    from batchjob.kernels.reference import w4a16 as ref

    return ref.pack_int4(u), scales.T.contiguous(), None if mins is None else mins.T.contiguous()


def matmul_case(group, with_mins, n, k, device):
    """Every row count and dtype, with and without a bias: within W4A16_TOLERANCE of the reference's largest result;
    fp16 (and bf16 on CUDA) also within 1.5 ulps of each result of the reference over weights rounded to that dtype,
    which is what the kernel's dot multiplies (under the interpreter bf16 takes the fp32 dot)."""
    from batchjob.kernels.reference import w4a16 as ref
    from batchjob.kernels.triton import w4a16 as tri

    u, scales, mins = int4_operands(group, with_mins, n, k, device, seed=group + n + k)
    qweight, s, z = _packed(u, scales, mins)
    g = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=g).to(device)
    worst = 0.0
    for m in ROWS:
        x = torch.randn(m, k, generator=g).to(device)
        for dtype in DTYPES:
            xd = x.to(dtype)
            for b in (None, bias):
                got = tri.w4a16_matmul(xd, qweight, s, z, group, b)
                want = ref.w4a16_matmul(xd, qweight, s, z, group, b)
                assert got.dtype == dtype and got.shape == (m, n)
                err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                assert err <= W4A16_TOLERANCE[dtype], (m, dtype, b is not None, err)
                if dtype == torch.float32:
                    worst = max(worst, err)
                if dtype == torch.float16 or (dtype == torch.bfloat16 and device != "cpu"):
                    w = ref.dequantize(qweight, s, z, group).to(dtype).float()
                    emu = xd.float() @ w + (0 if b is None else b)
                    ulps = (got.float() - emu).abs() / (emu.abs() * torch.finfo(dtype).eps + 1e-6)
                    assert ulps.max().item() <= 1.5, (m, dtype, ulps.max().item())
    return worst


def invariance_case(group, with_mins, device):
    """A row's result is the same bits alone, in a batch of 5 and in one of 40 (two row tiles), at any position."""
    from batchjob.kernels.triton import w4a16 as tri

    n, k = 96, 4 * group
    u, scales, mins = int4_operands(group, with_mins, n, k, device, seed=7)
    qweight, s, z = _packed(u, scales, mins)
    g = torch.Generator().manual_seed(8)
    x, bias = torch.randn(40, k, generator=g).to(device), torch.randn(n, generator=g).to(device)
    for dtype in DTYPES:
        xd = x.to(dtype)
        # under the interpreter (device cpu) tl.dot is numpy's matmul, whose fp32 summation order can follow the
        # operands' shapes (OpenBLAS's AVX2 kernels: a 5-row tile and a 40-row one differ in the last bits): there
        # fp32 is held to rounding, not bits; the kernel's own order (one K loop per tile) is what a GPU runs
        same = torch.equal if device != "cpu" or dtype != torch.float32 else _close
        full = tri.w4a16_matmul(xd, qweight, s, z, group, bias)
        some = tri.w4a16_matmul(xd[[33, 2, 17, 0, 39]], qweight, s, z, group, bias)
        assert same(some, full[[33, 2, 17, 0, 39]]), dtype
        for r in (0, 17, 33, 39):
            assert same(tri.w4a16_matmul(xd[r:r + 1], qweight, s, z, group, bias), full[r:r + 1]), (dtype, r)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def linear_case(device):
    """The start-up check passes and a W4A16Linear runs the Triton kernel: an Int4Weight (as quantize_int4 makes one,
    and one with mins), leading dims, a bias, against the matmul over Int4Weight.dequantized; rows of a wider tensor
    as a contiguous copy's; its bytes; on CUDA int4_linear builds it."""
    from batchjob.kernels.linear_quant import Int4Weight, quantize_int4
    from batchjob.kernels.linear_w4a16 import W4A16Linear, w4a16_backend
    from batchjob.kernels.triton import w4a16 as tri
    from batchjob.kernels.triton.check import check_w4a16

    assert check_w4a16(torch.device(device)) is None
    assert w4a16_backend(torch.device(device)) is tri
    g = torch.Generator().manual_seed(5)
    n, k = 72, 256
    bias = torch.randn(n, generator=g).to(device)
    u, scales, mins = int4_operands(64, True, n, k, device, seed=6)
    for w in (quantize_int4(torch.randn(n, k, generator=g).to(device), 32), Int4Weight(u, scales, 64, mins)):
        lin = W4A16Linear(w, bias)
        assert lin.kernel == "triton" and lin.out_features == n
        assert lin.nbytes == n * k // 2 + (4 if w.mins is None else 8) * n * (k // w.group) + 4 * n
        for dtype in DTYPES:
            x = torch.randn(2, 3, k, generator=g).to(device).to(dtype)
            got = lin(x)
            assert got.dtype == dtype and got.shape == (2, 3, n)
            want = (x.float() @ w.dequantized(torch.float32).T + bias).to(dtype)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            assert err <= W4A16_TOLERANCE[dtype], (dtype, err)
            wide = torch.randn(5, k + 24, generator=g).to(device).to(dtype)  # rows of a wider tensor: a row stride
            assert torch.equal(lin(wide[:, 8:k + 8]), lin(wide[:, 8:k + 8].contiguous())), dtype
    if device != "cpu":
        from batchjob.kernels.quantization import int4_linear

        assert isinstance(int4_linear(w, bias), W4A16Linear)


def cases(device: str) -> list:
    out = []
    for group, mins, n, k in MATMUL:
        name = f"w4a16 matmul g{group}{' mins' if mins else ''} {n}x{k}"
        out.append((name, lambda a=(group, mins, n, k): matmul_case(*a, device)))
    for group, mins in ((32, False), (128, True)):
        out.append((f"w4a16 batch invariance g{group}{' mins' if mins else ''}",
                    lambda a=(group, mins): invariance_case(*a, device)))
    out.append(("w4a16 W4A16Linear and the start-up check", lambda: linear_case(device)))
    return out


def run(device: str, only: str | None = None) -> int:
    failed = 0
    for name, fn in cases(device):
        if only and only not in name:
            continue
        t = time.perf_counter()
        try:
            detail = fn()
            print(f"ok   {name} ({time.perf_counter() - t:.1f} s){'' if detail is None else f' err {detail:.1e}'}", flush=True)
        except Exception as e:  # noqa: BLE001 - report every case, fail at the end
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
    return failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("-k", default=None)
    args = ap.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 to run the Triton kernels on the CPU", file=sys.stderr)
        return 2
    if args.device == "cpu":
        from tests.triton_interpreter import skip_repeated_patches

        skip_repeated_patches()
    failed = run(args.device, args.k)
    print(f"{failed} failed" if failed else "all passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
