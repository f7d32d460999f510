"""Attention past a query's own position where the step's metadata says so (`AttentionMetadata.key_ends`: a Gemma 3
image's tokens see the whole image, both ways): the torch reference (grouped and per row) and the native kernels
(every instruction-set path this CPU runs, fp32 and bf16 caches, plain and int8 caches) against a dense fp64 oracle
built from the mask alone, with and without a sliding window; a row's result stays bitwise the same alone or
batched. The Triton kernel's case runs with the other Triton cases (tests/kernels/triton_cases.py)."""
from __future__ import annotations

import pytest
import torch

from batchjob.kernels import select_kernels
from batchjob.kernels.reference.kernel_set import TorchKernels
from batchjob.kernels.reference.kv_quant import QuantizedKV
from tests.kernels.native_cases import DTYPES, Row, attend, isa, needs_native, paged_step, random_rows  # noqa: F401

# (cached, new) rows, decodes first, and each row's bidirectional runs [start, end) in absolute positions: a fresh
# prompt with one run, a continued chunk with two, a run that began in the cached prefix (a prefix-cache hit ending
# inside an image), a row with none
SPEC = [(0, 1), (40, 1), (0, 45), (16, 40), (31, 33), (0, 20)]
RUNS = [[], [], [(5, 21)], [(20, 37), (40, 50)], [(24, 50)], []]


def key_ends(spec, runs) -> torch.Tensor:
    """int32 [tokens]: a run's tokens see to its end; every other token 0 (causal)."""
    out = []
    for (cached, new), spans in zip(spec, runs):
        for p in range(cached, cached + new):
            out.append(next((e for s, e in spans if s <= p < e), 0))
    return torch.tensor(out, dtype=torch.int32)


def oracle(rows: list[Row], runs, window: int | None) -> torch.Tensor:
    """Each row's new tokens over its whole context in fp64, masked by position alone: key j is seen by the query at
    position p when j <= p or j is in p's run, and (window) p - j < window."""
    outs = []
    for r, spans in zip(rows, runs):
        ctx, g = r.cached + r.new, r.q.shape[1] // r.k.shape[1]
        k = r.k.double().repeat_interleave(g, dim=1)
        v = r.v.double().repeat_interleave(g, dim=1)
        pos = torch.arange(r.cached, ctx)
        end = torch.tensor([next((e for s, e in spans if s <= p < e), p + 1) for p in pos.tolist()])
        keys = torch.arange(ctx)
        mask = keys[None, :] < torch.maximum(end, pos + 1)[:, None]
        if window:
            mask &= keys[None, :] > pos[:, None] - window
        s = torch.einsum("qhd,khd->hqk", r.q.double(), k) * r.q.shape[-1] ** -0.5
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
    return torch.cat(outs)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("window", [None, 12])
def test_the_torch_reference_sees_each_run_whole(per_row, window):
    rows = random_rows(SPEC, 2, 3, 64, torch.float32, seed=3)
    ends = key_ends(SPEC, RUNS)
    out = torch.cat(attend(TorchKernels(per_row=per_row), rows, 16, window, key_ends=ends)).double()
    want = oracle(rows, RUNS, window)
    assert (out - want).abs().max().item() < 1e-5
    causal = oracle(rows, [[]] * len(rows), window)
    assert (want - causal).abs().max().item() > 0.1, "the runs changed nothing"


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("window", [None, 12])
def test_the_native_kernels_see_each_run_whole(dtype, window, isa):
    rows = random_rows(SPEC, 2, 3, 64, dtype, seed=3)
    ends = key_ends(SPEC, RUNS)
    kernels = select_kernels("native", "cpu", dtype, 64, 3, 16)
    out = torch.cat(attend(kernels, rows, 16, window, key_ends=ends)).double()
    tol = 3e-6 if dtype == torch.float32 else 2e-2
    assert (out - oracle(rows, RUNS, window)).abs().max().item() < tol
    # bitwise: each row alone (its own runs) as in the batch
    for i in range(len(rows)):
        alone = attend(kernels, [rows[i]], 16, window, key_ends=key_ends([SPEC[i]], [RUNS[i]]))[0]
        assert torch.equal(alone, out.split([r.new for r in rows])[i].to(alone.dtype)) or dtype == torch.float32 and \
            torch.equal(alone.double(), out.split([r.new for r in rows])[i])


@needs_native
def test_the_native_kernels_over_an_int8_cache_see_each_run_whole(isa):
    """Over the same quantized cache, the native kernel equals the torch reference's dequantized attention."""
    rows = random_rows(SPEC, 2, 3, 64, torch.float32, seed=3)
    ends = key_ends(SPEC, RUNS)
    outs = []
    for kernels in (select_kernels("native", "cpu", torch.float32, 64, 3, 16, kv_cache_dtype="int8"), TorchKernels()):
        num_blocks, slots, meta = paged_step(rows, 16)
        meta.key_ends = ends
        if isinstance(kernels, TorchKernels):
            kc, vc = (QuantizedKV.zeros(8, num_blocks, 16, 2, 64, "cpu") for _ in range(2))
        else:
            kc, vc = kernels.quantized_kv_caches(8, num_blocks, 16, 2, 64, lambda shape, dt: torch.zeros(shape, dtype=dt))
        for r, s in zip(rows, slots):
            kernels.store_kv(r.k, r.v, kc, vc, s)
        outs.append(kernels.attention(torch.cat([r.q for r in rows]), kc, vc, meta, 64 ** -0.5))
    assert (outs[0] - outs[1]).abs().max().item() < 5e-4  # the query's int8 split: tests/kernels/test_native_kv_quant.py
    assert (outs[1].double() - oracle(rows, RUNS, None)).abs().max().item() < 5e-2
