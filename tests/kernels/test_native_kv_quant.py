"""The native int8/int4 KV kernels (kernels/native/csrc/paged_attention_quant.cpp): the quantizing store gives
bitwise the codes and scales of kernels/reference/kv_quant.py, attention over them (with and without the logit
soft-cap) matches the torch reference over the same dequantized cache, a row's result is bitwise the same in any
batch, and jobs run on them.

On every instruction-set path this CPU runs (vec.h / vec_int.h: AVX-512, AVX2, generic C++; forced through
BATCHJOB_CPU_ISA): the whole matrix on the best path, a few cases of each on the lower ones, and the paths' results
compared bitwise (integer dot products are exact, the fp32 steps the same operations in the same order). The
AVX-512 build is at least compiled on any x86."""
from __future__ import annotations

import copy
import itertools
import os

import pytest
import torch

from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.params import SamplingParams
from batchjob.engine.core.sequence import Sequence
from batchjob.kernels import KernelError, select_kernels
from batchjob.kernels.native.build import compile_only, isa_runs_here
from batchjob.kernels.reference.kernel_set import TorchKernels
from batchjob.kernels.reference.kv_quant import QuantizedKV, dequantize, quantize
from batchjob.kernels.native.ops import PackedKV
from tests.builders import prompts
from tests.kernels.native_cases import BEST_ISA, DTYPES, RUNNABLE_ISAS, SPEC, needs_native, paged_step, random_rows

pytestmark = needs_native
BITS = [8, 4]
F32, BF16 = torch.float32, torch.bfloat16
ids = lambda d: str(d).removeprefix("torch.") if isinstance(d, torch.dtype) else None  # noqa: E731


def on_paths(full, few):
    """(isa, *case): every case of `full` on the best path, the cases `few` (SmolLM2's head_dim 64, GQA 3: one build
    per path) on each lower path."""
    return [(BEST_ISA, *c) for c in full] + [(isa, *c) for isa in RUNNABLE_ISAS[1:] for c in few]


@pytest.fixture(autouse=True)
def _forced_isa(request, monkeypatch):
    """A test parametrized with `isa` builds its kernels for that path (the path is read when they are built)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "isa" in callspec.params:
        monkeypatch.setenv("BATCHJOB_CPU_ISA", callspec.params["isa"])


def native(bits: int, head_dim: int, gqa: int, dtype: torch.dtype, block_size: int = 16):
    kernels = select_kernels("native", "cpu", dtype, head_dim, gqa, block_size, kv_cache_dtype=f"int{bits}")
    assert kernels.name == "native"
    assert os.environ.get("BATCHJOB_CPU_ISA", kernels.isa) == kernels.isa
    return kernels


def zeros(shape, dtype):
    return torch.zeros(shape, dtype=dtype)


def attend(kernels, rows, bits: int, block_size: int = 16, window=None, dtype=None, seed=0, threads=None, softcap=None):
    """Every row's attention output over a quantized cache the backend stored itself (native: PackedKV,
    torch: QuantizedKV), in shuffled blocks, decodes first."""
    dtype = dtype or rows[0].q.dtype
    hkv, d = rows[0].k.shape[1:]
    num_blocks, slots, meta = paged_step(rows, block_size, seed)
    if isinstance(kernels, TorchKernels):
        kc, vc = (QuantizedKV.zeros(bits, num_blocks, block_size, hkv, d, "cpu") for _ in range(2))
    else:
        kc, vc = kernels.quantized_kv_caches(bits, num_blocks, block_size, hkv, d, zeros)
    for r, s in zip(rows, slots):
        kernels.store_kv(r.k.to(dtype), r.v.to(dtype), kc, vc, s)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        out = kernels.attention(torch.cat([r.q for r in rows]).to(dtype), kc, vc, meta, d ** -0.5, window, softcap)
    finally:
        torch.set_num_threads(before)
    return list(out.split([r.new for r in rows]))


# the store writes KV heads, the GQA group does not enter it; a build holds both, so the store tests take the groups
# the attention tests build at these head dims (a group of its own was a quantized attention build more per head_dim
# and path: ~13 s of g++ each)
STORE_GQA = {64: 3, 80: 5, 128: 8}


@pytest.mark.parametrize("isa,bits,dtype,head_dim", on_paths(itertools.product(BITS, DTYPES, [64, 80, 128]),
                                                             [(8, F32, 64), (4, BF16, 64)]), ids=ids)
def test_the_store_writes_the_reference_codes_and_load_returns_their_values(isa, bits, dtype, head_dim):
    """Round trip: what load_kv reads back is bitwise kv_quant.dequantize(quantize(x)), so within half a
    scale step of x; tokens stored one at a time in random order (int4 V packs two tokens per byte) give
    the same cache as all at once; a slot of -1 is skipped."""
    kernels = native(bits, head_dim, STORE_GQA[head_dim], dtype)
    k = (torch.randn(70, 3, head_dim) * torch.linspace(0.01, 20, 70)[:, None, None]).to(dtype)
    v = torch.randn(70, 3, head_dim).to(dtype)
    k[5] = 0  # an all-zero token: scale 0, codes 0
    slots = torch.randperm(8 * 16)[:70]
    kc, vc = kernels.quantized_kv_caches(bits, 8, 16, 3, head_dim, zeros)
    kernels.store_kv(k, v, kc, vc, slots)
    got_k, got_v = kernels.load_kv(kc, vc, slots)
    for x, got in ((k, got_k), (v, got_v)):
        codes, scale = quantize(x, bits)
        want = dequantize(codes, scale, bits, head_dim, torch.float32)
        assert torch.equal(got, want)
        step = scale.float().repeat_interleave(head_dim // scale.shape[-1], dim=-1)
        assert bool(((got - x.float()).abs() <= step * 0.51 + 1e-6).all())
    one_by_one = kernels.quantized_kv_caches(bits, 8, 16, 3, head_dim, zeros)
    for i in torch.randperm(70).tolist():
        kernels.store_kv(k[i:i + 1], v[i:i + 1], *one_by_one, slots[i:i + 1])
    kernels.store_kv(k[:2], v[:2], *one_by_one, torch.tensor([-1, -1]))  # padding: nothing written
    for a, b in zip(kc.tensors() + vc.tensors(), one_by_one[0].tensors() + one_by_one[1].tensors()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("isa,bits,head_dim,gqa,block_size,dtype", on_paths(
    [(b, *shape, bs, dt) for b, shape, bs, dt in itertools.product(BITS, [(64, 3), (80, 5), (96, 4), (128, 8)], [16, 32], DTYPES)],
    [(8, 64, 3, 16, BF16), (4, 64, 3, 32, F32)]), ids=ids)
def test_native_attention_over_a_quantized_cache_matches_the_dequantized_reference(isa, bits, head_dim, gqa, block_size,
                                                                                   dtype):
    """Against the fp32 torch reference over the same codes (QuantizedKV, dequantized): what remains is the
    query's two-part int8 split (~16 bits), P x V scale in 15 bits, and bf16 output rounding."""
    kernels = native(bits, head_dim, gqa, dtype, block_size)
    rows = random_rows(SPEC, 2, gqa, head_dim, dtype, seed=head_dim + gqa)
    for window in (None, 24):
        out = torch.cat(attend(kernels, rows, bits, block_size, window)).float()
        ref = torch.cat(attend(TorchKernels(), rows, bits, block_size, window, dtype=torch.float32))
        if dtype == torch.float32:
            assert (out - ref).abs().max().item() < 5e-4 and (out - ref).abs().mean().item() < 3e-5, window
        else:  # as close as torch's own bf16 attention over the same cache, give or take
            mine = (out - ref).abs().mean().item()
            theirs = (torch.cat(attend(TorchKernels(), rows, bits, block_size, window)).float() - ref).abs().mean().item()
            assert mine <= theirs * 2.5 and (out - ref).abs().max().item() < 5e-2, (mine, theirs)


@pytest.mark.parametrize("isa,bits,head_dim,gqa,dtype", on_paths(  # SmolLM2's shape; Gemma 2's head_dim
    [(b, *shape, dt) for b, shape, dt in itertools.product(BITS, [(64, 3), (256, 2)], DTYPES)], [(4, 64, 3, F32)]), ids=ids)
def test_native_attention_over_a_quantized_cache_with_a_logit_soft_cap(isa, bits, head_dim, gqa, dtype):
    """Gemma 2's tanh(s / cap) * cap on the scores, against the fp32 reference over the same codes, with and
    without a sliding window; a row's result still bitwise the same alone. The queries are scaled x4 so that
    the scores go past the cap, where the tanh bends them."""
    kernels = native(bits, head_dim, gqa, dtype)
    rows = random_rows(SPEC, 2, gqa, head_dim, dtype, seed=head_dim + gqa)
    for r in rows:
        r.q = r.q * 4
    for window in (None, 24):
        out = torch.cat(attend(kernels, rows, bits, 16, window, softcap=5.0)).float()
        ref = torch.cat(attend(TorchKernels(), rows, bits, 16, window, dtype=torch.float32, softcap=5.0))
        uncapped = torch.cat(attend(TorchKernels(), rows, bits, 16, window, dtype=torch.float32))
        assert (uncapped - ref).abs().max() > 0.05  # the cap changes the result
        if dtype == torch.float32:
            assert (out - ref).abs().max().item() < 5e-4 and (out - ref).abs().mean().item() < 3e-5, window
        else:
            mine = (out - ref).abs().mean().item()
            theirs = (torch.cat(attend(TorchKernels(), rows, bits, 16, window, softcap=5.0)).float() - ref).abs().mean().item()
            assert mine <= theirs * 2.5 and (out - ref).abs().max().item() < 5e-2, (mine, theirs)
    batch = attend(kernels, rows, bits, window=24, softcap=5.0, threads=2)
    for i in (0, 3, 5, 7):
        assert torch.equal(attend(kernels, [rows[i]], bits, window=24, seed=i + 1, threads=1, softcap=5.0)[0], batch[i]), i


@pytest.mark.parametrize("isa,bits,dtype", on_paths(itertools.product(BITS, DTYPES), [(8, BF16), (4, F32)]), ids=ids)
def test_a_rows_attention_is_bitwise_the_same_alone_or_in_any_batch_and_thread_count(isa, bits, dtype):
    rows = random_rows([(40, 1), (333, 1), (0, 1), (17, 1), (0, 45), (16, 9), (100, 50)], 2, 3, 64, dtype, seed=3)
    kernels = native(bits, 64, 3, dtype)
    batch = attend(kernels, rows, bits, threads=2)
    for i, r in enumerate(rows):
        alone = attend(kernels, [r], bits, seed=i + 11, threads=1)[0]
        assert torch.equal(alone, batch[i]), i
    order = [3, 0, 2, 1, 6, 4, 5]  # decodes still first
    shuffled = attend(kernels, [rows[i] for i in order], bits, seed=5, threads=2)
    for j, i in enumerate(order):
        assert torch.equal(shuffled[j], batch[i])


@pytest.mark.parametrize("isa,bits", on_paths([(8,), (4,)], [(4,)]))
def test_a_tokens_attention_is_the_same_decoded_or_in_any_prefill_chunk(isa, bits):
    """Recompute after preemption, chunked prefill and prefix hits see the same numbers as decoding."""
    dtype = DTYPES[-1]
    kernels = native(bits, 64, 3, dtype)
    (whole,) = random_rows([(0, 60)], 2, 3, 64, dtype, seed=9)
    full = attend(kernels, [whole], bits)[0]
    for cut in (1, 16, 33, 59):
        part = type(whole)(cut, 60 - cut, whole.k, whole.v, whole.q[cut:])
        assert torch.equal(attend(kernels, [part], bits, seed=cut)[0], full[cut:]), cut
    last = type(whole)(59, 1, whole.k, whole.v, whole.q[59:])
    assert torch.equal(attend(kernels, [last], bits)[0], full[59:])


def test_every_instruction_set_path_gives_the_same_bits(monkeypatch):
    """The store's codes and scales and attention over them (decodes, prefill, an extend; window, soft-cap; fp32
    and bf16; int8 and int4) are bitwise the same on every path this CPU runs: the dot products are exact integer
    sums (VNNI or its emulation), every fp32 step the same operation in the same order."""
    if len(RUNNABLE_ISAS) < 2:
        pytest.skip("one instruction-set path runs here")
    rows = random_rows(SPEC, 2, 3, 64, F32, seed=7)
    results = {}
    for isa in RUNNABLE_ISAS:
        monkeypatch.setenv("BATCHJOB_CPU_ISA", isa)
        got = []
        for bits, dtype in itertools.product(BITS, DTYPES):
            kernels = native(bits, 64, 3, dtype)
            assert kernels.isa == isa
            got += attend(kernels, rows, bits, window=24, dtype=dtype) + attend(kernels, rows, bits, dtype=dtype, softcap=5.0)
            kc, vc = kernels.quantized_kv_caches(bits, 8, 16, 2, 64, zeros)
            slots = torch.randperm(8 * 16, generator=torch.Generator().manual_seed(bits))[:50]
            kernels.store_kv(rows[-1].k[:50].to(dtype), rows[-1].v[:50].to(dtype), kc, vc, slots)
            got += [*kc.tensors(), *vc.tensors(), *kernels.load_kv(kc, vc, slots)]
        results[isa] = got
    first, *others = RUNNABLE_ISAS
    for other in others:
        assert len(results[other]) == len(results[first])
        for i, (a, b) in enumerate(zip(results[first], results[other])):
            assert torch.equal(a, b), (first, other, i)


@pytest.mark.skipif(not isa_runs_here("avx2") and not isa_runs_here("avx512"), reason="not an x86 CPU")
@pytest.mark.parametrize("source", ["paged_attention_quant.cpp", "kv_quant_store.cpp"])
def test_the_avx512_build_of_the_quantized_kernels_compiles_on_any_x86(source):
    """The AVX-512 path (with VNNI and AVX512-BF16 targeted) is at least compiled where the CPU cannot run it."""
    compile_only(source, {"HEAD_DIM": 64, "GQA": 3, "GROUP": 16}, "avx512")


def test_auto_picks_native_for_a_quantized_cache_and_says_why_when_it_cannot(monkeypatch):
    """Native reads int8 and int4 caches on every path; what it cannot take (a block size that is not whole
    16-key tiles, int4 groups that are not whole 16-dim vectors) sends auto to the torch references with the
    reason, and an explicit 'native' to an error saying it."""
    assert isinstance(native(8, 64, 3, torch.float32), type(select_kernels("auto", "cpu", torch.float32, 64, 3, 16,
                                                                               kv_cache_dtype="int8")))
    logged = []
    assert select_kernels("auto", "cpu", torch.float32, 64, 3, 8, log=logged.append, kv_cache_dtype="int4").name == "torch"
    assert "block_size 8 (multiples of 16)" in logged[0] and "torch reference" in logged[0]
    with pytest.raises(KernelError, match="'native' cannot run here.*block_size 8"):
        select_kernels("native", "cpu", torch.float32, 64, 3, 8, kv_cache_dtype="int8")
    from batchjob.kernels.native import ops as native_module

    monkeypatch.setattr(native_module, "group4", lambda head_dim: 24)
    with pytest.raises(KernelError, match="'native' cannot run here.*int4 groups of 24"):
        select_kernels("native", "cpu", torch.float32, 64, 3, 16, kv_cache_dtype="int4")


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_the_engine_on_native_quantized_kv_keeps_the_text_of_the_reference_kernels(kv, tiny_model):  # noqa: F811
    """Greedy text on PackedKV caches against the torch reference kernels over the same quantized cache
    (a 16-bit query and 15-bit P, so not bitwise). Against the unquantized cache: tests/kernels/test_kv_quant.py."""

    def run(kernels, kv_dtype):
        m = copy.copy(tiny_model)
        m.kv_cache_dtype, m.kernel_choice, m.block_size = kv_dtype, kernels, None
        engine = Engine(m, [], EngineConfig(block_size=16, num_blocks=256))
        assert isinstance(engine.runner.kv.layers[0][0], PackedKV if kernels == "native" and kv_dtype != "auto" else
                          (QuantizedKV if kv_dtype != "auto" else torch.Tensor))
        seqs = [Sequence(i, p, SamplingParams(max_tokens=8)) for i, p in enumerate(prompts(40, seed=4, lo=10, hi=60))]
        for s in seqs:
            assert engine.add(s) is None
        while engine.has_work:
            engine.step()
        return [s.output_ids for s in seqs]

    mine, ref = run("native", kv), run("torch", kv)
    same = lambda a, b: sum(x == y for x, y in zip(a, b)) / len(a)  # noqa: E731
    assert same(mine, ref) >= 0.95, same(mine, ref)
