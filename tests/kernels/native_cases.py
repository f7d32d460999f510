"""Paged-attention cases shared by the native kernel tests: random rows of cached and new tokens, a step over
them in shuffled blocks, the dtypes the native kernels run, and the instruction-set paths this CPU runs (`isa`:
a fixture that builds the kernels for each of them)."""
from __future__ import annotations

from dataclasses import dataclass

import shutil

import pytest
import torch

from batchjob.kernels import AttentionMetadata
from batchjob.kernels.native.build import ISAS, cpu_identity, isa_runs_here

HAS_AVX512 = isa_runs_here("avx512")
HAS_BF16 = HAS_AVX512 and "avx512_bf16" in cpu_identity()[1]
RUNNABLE_ISAS = [isa for isa in ISAS if isa_runs_here(isa)]  # best first
BEST_ISA = RUNNABLE_ISAS[0]
needs_native = pytest.mark.skipif(shutil.which("g++") is None, reason="the native kernels need a C++ compiler (g++)")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=RUNNABLE_ISAS)
def isa(request, monkeypatch) -> str:
    """Each instruction-set path this CPU runs (AVX-512, AVX2, generic), forced through BATCHJOB_CPU_ISA."""
    monkeypatch.setenv("BATCHJOB_CPU_ISA", request.param)
    return request.param



@dataclass
class Row:
    """One row of a step: `cached` tokens already in the KV cache, `new` ones computed now; k, v for its
    whole context [cached + new, Hkv, D], q for its new tokens [new, H, D]."""
    cached: int
    new: int
    k: torch.Tensor
    v: torch.Tensor
    q: torch.Tensor


def random_rows(spec, kv_heads, gqa, head_dim, dtype, seed=0) -> list[Row]:
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    return [Row(c, n, rnd(c + n, kv_heads, head_dim), rnd(c + n, kv_heads, head_dim), rnd(n, kv_heads * gqa, head_dim))
            for c, n in spec]


def attend(kernels, rows: list[Row], block_size: int, window=None, dtype=None, seed=0, softcap=None,
           key_ends: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Every row's attention output for its new tokens: K/V stored through the backend's own store_kv
    (each backend lays its cache out its own way) into shuffled blocks, rows in the given order
    (decodes first, as the model runner lays them out); `window`, `softcap`, `key_ends` (the metadata's) as the
    attention op takes them."""
    dtype = dtype or rows[0].q.dtype
    kv_heads, head_dim = rows[0].k.shape[1:]
    num_blocks, slots, meta = paged_step(rows, block_size, seed)
    meta.key_ends = key_ends
    ks, vs = kernels.kv_cache_shapes(num_blocks, block_size, kv_heads, head_dim)
    kc, vc = torch.zeros(ks, dtype=dtype), torch.zeros(vs, dtype=dtype)
    for r, s in zip(rows, slots):
        kernels.store_kv(r.k.to(dtype), r.v.to(dtype), kc, vc, s)
    out = kernels.attention(torch.cat([r.q for r in rows]).to(dtype), kc, vc, meta, head_dim ** -0.5, window, softcap)
    return list(out.split([r.new for r in rows]))


def paged_step(rows: list[Row], block_size: int, seed: int = 0) -> tuple[int, list[torch.Tensor], AttentionMetadata]:
    """A step over `rows` in shuffled blocks: the pool's block count, each row's context slots, the metadata."""
    assert all(r.new == 1 for r in rows[:sum(r.new == 1 for r in rows)]), "decodes first"
    need = [-(-(r.cached + r.new) // block_size) for r in rows]
    perm = torch.randperm(sum(need) + 2, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(len(rows))]
    slot = lambda t, p: t[p // block_size] * block_size + p % block_size  # noqa: E731
    bt = torch.zeros(len(rows), max(need), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    qsl = [0]
    for r in rows:
        qsl.append(qsl[-1] + r.new)
    meta = AttentionMetadata(
        bt, torch.tensor([r.cached + r.new for r in rows], dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
        torch.tensor([slot(t, p) for r, t in zip(rows, tables) for p in range(r.cached, r.cached + r.new)]),
        sum(r.new == 1 for r in rows))
    slots = [torch.tensor([slot(t, p) for p in range(r.cached + r.new)]) for r, t in zip(rows, tables)]
    return len(perm), slots, meta


# decodes (short and spanning many blocks), fresh prompts, chunked-prefill continuations and prefix hits
SPEC = [(0, 1), (15, 1), (40, 1), (333, 1), (0, 7), (0, 45), (16, 9), (100, 50), (31, 33)]
