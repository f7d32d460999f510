"""Quantized KV cache (kernels/reference/kv_quant.py): codes and scales within their bounds, attention over them
close to the unquantized cache's, and the engine's machinery (pool sizing, swap preemption, prefix
caching, the fingerprint) working with quantized blocks. Quality on SmolLM2: bench/kv_quality.py."""
from __future__ import annotations

import copy
import shutil

import pytest
import torch

from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.worker.kv_cache import KVCache
from batchjob.engine.core.scheduler import SchedulerConfig
from batchjob.engine.params import SamplingParams
from batchjob.engine.core.sequence import Sequence
from batchjob.kernels import AttentionMetadata, KernelError, paged_attention_torch, select_kernels, store_kv
from batchjob.kernels.reference.kv_quant import GROUP4, QuantizedKV, dequantize, quantize
from batchjob.kernels.native.ops import PackedKV
from tests.builders import prompts
from tests.kernels.native_cases import needs_native

HAS_COMPILER = shutil.which("g++") is not None  # the native kernels build (they read int8/int4 on every CPU path)


@pytest.mark.parametrize("bits", [8, 4])
def test_codes_round_to_the_nearest_step_of_their_scale(bits):
    x = torch.randn(50, 3, 64) * torch.linspace(0.01, 30, 50)[:, None, None]
    x[7] = 0  # an all-zero token: scale 0, codes 0, no NaN
    q, s = quantize(x, bits)
    back = dequantize(q, s, bits, 64, torch.float32)
    step = s.float().repeat_interleave(64 if bits == 8 else GROUP4, dim=-1)
    # half a step of rounding, plus the scale's own fp16 rounding at the edge of the range
    assert bool(((back - x).abs() <= step * (0.5 + 0.01) + 1e-6).all())
    assert torch.equal(back[7], torch.zeros(3, 64)) and not back.isnan().any()
    assert q.shape == ((50, 3, 64) if bits == 8 else (50, 3, 32)) and s.dtype == torch.float16


@pytest.mark.parametrize("bits", [8, 4])
def test_attention_over_a_quantized_cache_is_close_to_the_unquantized_one(bits):
    torch.manual_seed(0)
    hkv, d, bs, blocks = 2, 64, 16, 32
    spec = [(40, 1), (100, 1), (0, 9), (30, 7)]  # (cached, new): decodes, a fresh prompt, an extend
    tables = torch.randperm(blocks)[: 7 * len(spec)].view(len(spec), 7).to(torch.int32)
    lens = [c + n for c, n in spec]
    qsl = [0]
    for _, n in spec:
        qsl.append(qsl[-1] + n)
    ctx = [int(tables[r, p // bs]) * bs + p % bs for r, (c, n) in enumerate(spec) for p in range(c + n)]
    k, v = torch.randn(len(ctx), hkv, d), torch.randn(len(ctx), hkv, d)
    new = [int(tables[r, p // bs]) * bs + p % bs for r, (c, n) in enumerate(spec) for p in range(c, c + n)]
    meta = lambda: AttentionMetadata(tables, torch.tensor(lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),  # noqa: E731
                                     torch.tensor(new), 2)
    q = torch.randn(qsl[-1], hkv * 3, d)
    plain = [torch.zeros(blocks, bs, hkv, d) for _ in range(2)]
    quant = [QuantizedKV.zeros(bits, blocks, bs, hkv, d, "cpu") for _ in range(2)]
    store_kv(k, v, *plain, torch.tensor(ctx))
    store_kv(k, v, *quant, torch.tensor(ctx))
    ref = paged_attention_torch(q, *plain, meta(), d ** -0.5)
    got = paged_attention_torch(q, *quant, meta(), d ** -0.5)
    err = (got - ref).abs().mean().item() / ref.abs().mean().item()
    assert err < (0.01 if bits == 8 else 0.12), err


def test_a_slot_of_minus_one_is_not_stored():
    cache = QuantizedKV.zeros(8, 2, 4, 1, 64, "cpu")
    cache.store(torch.ones(2, 1, 64), torch.tensor([3, -1]))
    assert cache.data.view(-1, 64)[3].eq(127).all() and cache.data.view(-1, 64)[[0, 1, 2, 4, 5, 6, 7]].eq(0).all()


def _quantized(model, kv):
    m = copy.copy(model)
    m.kv_cache_dtype = kv
    m.block_size = None  # fit_kernels chooses again, for this cache
    return m


@pytest.mark.parametrize("kv", ["int8", "int4"])
@pytest.mark.parametrize("block_size", [8, 16])  # 8: the torch references' QuantizedKV; 16: native PackedKV where it builds
def test_the_pool_holds_more_tokens_and_swap_preemption_and_prefix_caching_keep_the_text(tiny_model, kv, block_size):  # noqa: F811
    model = _quantized(tiny_model, kv)
    bf16 = 2 * 2 * 2 * 16 * 2  # per token: K and V, 2 layers, 2 KV heads, head_dim 16, 2 bytes
    per_token = KVCache.bytes_per_block(model, 16) / 16
    # K and V x 2 layers x 2 KV heads x (codes + fp16 scales): int8 16 + 2 bytes, int4 8 + 2 (one group of 16)
    assert per_token == {"int8": 2 * 2 * 2 * (16 + 2), "int4": 2 * 2 * 2 * (8 + 2)}[kv] < bf16 / 1.7
    ps = prompts(12, seed=8, lo=20, hi=90)
    shared = ps[0][:40]
    ps += [shared + p[:5] for p in ps[:4]]  # prefix-cache hits
    params = SamplingParams(max_tokens=20, temperature=0.7)

    def run(**cfg):
        engine = Engine(model, [], EngineConfig(block_size=block_size, **cfg))
        seqs = [Sequence(i, p, params, rng_key=i) for i, p in enumerate(ps)]
        for s in seqs:
            assert engine.add(s) is None
        swaps = 0
        while engine.has_work:
            engine.step()
            swaps += len(engine.last_step.swap_out) if engine.last_step else 0
        cache = engine.runner.kv.layers[0][0]
        assert isinstance(cache, PackedKV if engine.runner.model.kernels.name == "native" else QuantizedKV)
        assert block_size == 8 or engine.runner.model.kernels.name == "native" or not HAS_COMPILER
        return [s.output_ids for s in seqs], swaps

    roomy, _ = run(num_blocks=512)
    tight, swaps = run(num_blocks=40, num_host_blocks=200, scheduler=SchedulerConfig(preemption="swap"))
    assert swaps > 0 and tight == roomy
    uncached, _ = run(num_blocks=512, enable_prefix_caching=False)
    assert uncached == roomy


def test_which_kernels_read_a_quantized_cache():
    """The references, native (tests/kernels/test_native_kv_quant.py) and Triton (tests/kernels/triton_cases.py) read int8
    and int4; Triton's int4 store needs head_dim / 2 a power of two."""
    assert select_kernels("torch", "cpu", torch.float32, 64, 3, 16, kv_cache_dtype="int8").name == "torch"
    if HAS_COMPILER:  # on every instruction-set path (tests/kernels/test_native_kv_quant.py)
        assert select_kernels("auto", "cpu", torch.float32, 64, 3, 16, kv_cache_dtype="int4").name == "native"
    with pytest.raises(KernelError, match="'triton' does not read a int4 KV cache with head_dim 80 yet"):
        select_kernels("triton", "cpu", torch.float32, 80, 3, 16, kv_cache_dtype="int4")  # head_dim / 2 = 40


def test_a_job_on_an_int8_cache_resumes_and_refuses_to_continue_on_another_cache(tmp_path, tiny_model_dir):
    from click.testing import CliRunner

    from batchjob.cli.main import main
    from batchjob.io.parts import read_results
    from tests.builders import write_jsonl

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i} of the int8 job"} for i in range(8)])
    base = ["run", "--model", str(tiny_model_dir("llama")), "--input", str(src), "--output", str(tmp_path / "out"),
            "--max-tokens", "6", "--dtype", "float32", "--no-progress"]
    first = CliRunner().invoke(main, [*base, "--kv-cache-dtype", "int8", "--limit", "3"])
    assert first.exit_code == 0, first.output
    other = CliRunner().invoke(main, base)
    assert other.exit_code == 1 and "params.kv_cache_dtype" in other.output
    rest = CliRunner().invoke(main, [*base, "--kv-cache-dtype", "int8"])
    assert rest.exit_code == 0, rest.output
    assert sorted(read_results(tmp_path / "out").column("row_index").to_pylist()) == list(range(8))


@pytest.mark.parametrize("kernels", ["torch", pytest.param("native", marks=needs_native)])
def test_a_greedy_job_on_an_int8_cache_agrees_with_the_unquantized_one_on_95_percent_of_rows(tmp_path, tiny_model_dir, kernels):
    """Over 8 tokens. A random tiny model's logits are nearly flat, so longer texts drift apart by chance
    (16 tokens: 56 of 60 rows agreed here); SmolLM2's figures are bench/kv_quality.py's."""
    from click.testing import CliRunner

    from batchjob.cli.main import main
    from batchjob.io.parts import read_results
    from tests.builders import write_jsonl

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i}: " + "alpha beta gamma " * (i % 5)} for i in range(200)])
    texts = {}
    for kv in ("auto", "int8"):
        out = tmp_path / kv
        done = CliRunner().invoke(main, ["run", "--model", str(tiny_model_dir("llama")), "--input", str(src), "--output",
                                         str(out), "--max-tokens", "8", "--dtype", "float32", "--kernels", kernels,
                                         "--kv-cache-dtype", kv, "--no-progress"])
        assert done.exit_code == 0, done.output
        texts[kv] = read_results(out).sort_by("row_index").column("generated_text").to_pylist()
    same = sum(a == b for a, b in zip(texts["auto"], texts["int8"]))
    print(f"{kernels}: {same} of 200 rows agree")
    assert same >= 0.95 * 200, same
