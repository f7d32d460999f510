"""W4A16 on group-wise int4 weights (kernels/linear_w4a16.py): the packed layout and the torch reference here; the
Triton kernel against the reference under the interpreter through tests/kernels/w4a16_cases.py, in a process of its
own (the interpreter flag must be set before triton is imported). On CUDA the same cases run in `make gpu-check`."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.background import BackgroundRun, starts_early

from batchjob.kernels.linear_quant import Int4Weight, quantize_int4
from batchjob.kernels.reference import w4a16 as ref

REPO = Path(__file__).resolve().parents[2]


def test_codes_pack_eight_to_an_int32_along_k():
    g = torch.Generator().manual_seed(0)
    for k in (36, 40, 256):  # 36 ends inside a word: its last word's high codes are 0
        u = torch.randint(0, 16, (5, k), generator=g, dtype=torch.uint8)
        q = ref.pack_int4(u)
        assert q.dtype == torch.int32 and q.shape == (-(-k // 8), 5)
        assert torch.equal(ref.unpack_int4(q, k).T, u.long())
    u = torch.arange(16, dtype=torch.uint8).view(1, 16)
    assert ref.pack_int4(u)[:, 0].tolist() == [0x76543210, 0xFEDCBA98 - 2 ** 32]  # code 8j + i in bits 4i..4i+3


def test_the_reference_computes_over_the_int4_weights_values():
    """Dequantized values bitwise Int4Weight.dequantized's (symmetric and with mins); the matmul in fp32, one cast."""
    g = torch.Generator().manual_seed(1)
    n, k, group = 48, 192, 64
    u = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.02
    for w in (Int4Weight(u, scales, group), Int4Weight(u, scales, group, -scales * 3), quantize_int4(torch.randn(n, k), 32)):
        s, z = w.scales.T.contiguous(), None if w.mins is None else w.mins.T.contiguous()
        values = ref.dequantize(ref.pack_int4(w.u), s, z, w.group)
        assert torch.equal(values.T, w.dequantized(torch.float32))
        x, bias = torch.randn(3, k, generator=g).to(torch.bfloat16), torch.randn(n, generator=g)
        got = ref.w4a16_matmul(x, ref.pack_int4(w.u), s, z, w.group, bias)
        assert got.dtype == torch.bfloat16 and torch.equal(got, (x.float() @ values + bias).to(torch.bfloat16))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs Triton on the CPU")
def test_on_the_cpu_w4a16linear_runs_the_reference_and_says_why(caplog):
    from batchjob.kernels.linear_w4a16 import W4A16Linear, w4a16_backend

    w4a16_backend.cache_clear()
    w = quantize_int4(torch.randn(40, 128, generator=torch.Generator().manual_seed(2)), 32)
    with caplog.at_level(logging.WARNING, logger="batchjob.kernels.linear_w4a16"):
        lin = W4A16Linear(w)
    assert lin.kernel == "reference" and "running the torch reference" in caplog.text
    assert lin.formats == {"int4 g32": 40 * 128}
    x = torch.randn(2, 4, 128)
    assert torch.equal(lin(x), lin.reference(x)) and lin(x).shape == (2, 4, 40)
    assert lin.nbytes == 40 * 128 // 2 + 4 * 40 * 4
    with pytest.raises(ValueError, match="groups of 32"):
        W4A16Linear(Int4Weight(w.u, w.scales[:, :3], 32))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles the GPU kernel, not the interpreted one")
@pytest.mark.parametrize("capability", [80, 90])
def test_the_kernel_compiles_for_ampere_and_hopper_without_a_gpu(capability):
    """What the interpreter lets pass and a GPU refuses (tile shapes, dot operand types, shared memory) fails here:
    the kernel compiled ahead of time to PTX and cubin for sm_80 / sm_90, tensor-core dots (mma) for fp16 and bf16,
    shared memory within the 99 KB every CUDA GPU since Ampere gives a block."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from batchjob.kernels.triton.w4a16 import BLOCK_M, BLOCK_N, NUM_WARPS, _w4a16_kernel, block_k

    for dtype, group, mins in (("fp16", 128, False), ("bf16", 32, True), ("bf16", 8, False), ("fp32", 64, True)):
        sig = {"X": f"*{dtype}", "Q": "*i32", "S": "*fp32", "Z": "*fp32", "B": "*fp32", "OUT": f"*{dtype}", "M": "i32",
               "N": "i32", "K": "i32", "stride_xm": "i32"}
        consts = {"GROUP": group, "HAS_MINS": mins, "HAS_BIAS": True, "DOT_F32": dtype == "fp32", "BM": BLOCK_M,
                  "BN": BLOCK_N, "BK": block_k(group)}
        sig.update(dict.fromkeys(consts, "constexpr"))
        src = ASTSource(_w4a16_kernel, sig, {(list(sig).index(name),): v for name, v in consts.items()})
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": NUM_WARPS})
        except RuntimeError as e:
            if "ptxas" in str(e).lower() and "not found" in str(e).lower():
                pytest.skip(f"no ptxas here: {e}")
            raise
        assert ("mma" in kernel.asm["ptx"]) == (dtype != "fp32"), (dtype, group)
        assert kernel.metadata.shared <= 99 * 1024, (dtype, group, kernel.metadata.shared)


W4A16_CASES = BackgroundRun([sys.executable, "-m", "tests.kernels.w4a16_cases", "--device", "cpu"],
                            {"TRITON_INTERPRET": "1"})


@starts_early(W4A16_CASES)  # the interpreter: one Python thread, beside the rest of the suite
def test_the_triton_kernel_matches_the_reference_under_the_interpreter():
    """Symmetric and with mins, groups of 4 to 128, 1, 5 and 33 rows, fp32/fp16/bf16; batch invariance; W4A16Linear
    and the start-up check on the Triton kernel (tests/kernels/w4a16_cases.py)."""
    pytest.importorskip("triton")
    out = W4A16_CASES.result()
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert out.stdout.count("ok ") == 10 and "all passed" in out.stdout, out.stdout
