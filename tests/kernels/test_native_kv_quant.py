"""The native int8/int4 KV kernels (kernels/native/csrc/paged_attention_quant.cpp): the quantizing store gives
bitwise the codes and scales of kernels/reference/kv_quant.py, attention over them (with and without the logit
soft-cap) matches the torch reference over the same dequantized cache, a row's result is bitwise the same in any
batch, and jobs run on them."""
from __future__ import annotations

import copy

import pytest
import torch

from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.core.sequence import SamplingParams, Sequence
from batchjob.kernels import KernelError, select_kernels
from batchjob.kernels.native.build import cpu_identity
from batchjob.kernels.reference.kernel_set import TorchKernels
from batchjob.kernels.reference.kv_quant import QuantizedKV, dequantize, quantize
from batchjob.kernels.native.ops import PackedKV
from tests.builders import prompts
from tests.kernels.native_cases import DTYPES, SPEC, paged_step, random_rows

HAS_VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= cpu_identity()[1]
pytestmark = pytest.mark.skipif(not HAS_VNNI, reason="the native quantized kernels need AVX512-VNNI")
BITS = [8, 4]
ids = lambda d: str(d).removeprefix("torch.")  # noqa: E731


def native(bits: int, head_dim: int, gqa: int, dtype: torch.dtype, block_size: int = 16):
    kernels = select_kernels("native", "cpu", dtype, head_dim, gqa, block_size, kv_cache_dtype=f"int{bits}")
    assert kernels.name == "native"
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


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_the_store_writes_the_reference_codes_and_load_returns_their_values(bits, dtype, head_dim):
    """Round trip: what load_kv reads back is bitwise kv_quant.dequantize(quantize(x)), so within half a
    scale step of x; tokens stored one at a time in random order (int4 V packs two tokens per byte) give
    the same cache as all at once; a slot of -1 is skipped."""
    kernels = native(bits, head_dim, 2, dtype)
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


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim,gqa", [(64, 3), (80, 5), (96, 4), (128, 8)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_native_attention_over_a_quantized_cache_matches_the_dequantized_reference(bits, head_dim, gqa, block_size, dtype):
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


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim,gqa", [(64, 3), (256, 2)])  # SmolLM2's shape; Gemma 2's head_dim
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_native_attention_over_a_quantized_cache_with_a_logit_soft_cap(bits, head_dim, gqa, dtype):
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


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_a_rows_attention_is_bitwise_the_same_alone_or_in_any_batch_and_thread_count(bits, dtype):
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


@pytest.mark.parametrize("bits", BITS)
def test_a_tokens_attention_is_the_same_decoded_or_in_any_prefill_chunk(bits):
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


def test_auto_picks_native_for_a_quantized_cache_and_says_why_when_it_cannot(monkeypatch):
    assert isinstance(native(8, 64, 3, torch.float32), type(select_kernels("auto", "cpu", torch.float32, 64, 3, 16,
                                                                               kv_cache_dtype="int8")))
    from batchjob.kernels.native import ops as native_module

    flags = cpu_identity()[1] - {"avx512_vnni"}
    monkeypatch.setattr(native_module, "cpu_identity", lambda: ("a CPU without VNNI", flags))
    logged = []
    assert select_kernels("auto", "cpu", torch.float32, 64, 3, 16, log=logged.append, kv_cache_dtype="int4").name == "torch"
    assert "int4 KV cache on this CPU (it needs AVX512-VNNI)" in logged[0] and "torch reference" in logged[0]
    with pytest.raises(KernelError, match="'native' cannot run here.*AVX512-VNNI"):
        select_kernels("native", "cpu", torch.float32, 64, 3, 16, kv_cache_dtype="int8")


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
