"""The compiled CPU kernels (kernels/native/csrc/paged_attention.cpp, fused.cpp) against the fp32 torch reference,
their bitwise batch invariance, and how they are built: compiled at first use, cached, concurrent builders,
and the fallback to the torch reference where they cannot be built."""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchjob.kernels import KernelError, select_kernels
from batchjob.kernels.native.build import BuildError, build, cpu_identity
from batchjob.kernels.reference.kernel_set import TorchKernels
from batchjob.kernels.native.build import isa_runs_here
from tests.background import BackgroundRun, starts_early
from tests.kernels.compile_checks import compile_every_path
from tests.kernels.native_cases import BEST_ISA, DTYPES, HAS_BF16, RUNNABLE_ISAS, SPEC, Row, attend, isa, needs_native, random_rows  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
NATIVE_BUILDS = BackgroundRun([sys.executable, "-m", "tests.kernels.native_builds"])


@needs_native
@starts_early(NATIVE_BUILDS)  # one g++ per core into the kernel cache, beside the suite, before the tests load them
def test_every_kernel_build_the_suite_loads_compiles_on_each_path_this_cpu_runs():
    """tests/kernels/native_builds.py: each specialisation the native tests and the tiny models load, for the best
    path (every shape) and each lower one (theirs), is in the kernel cache, compiled side by side."""
    from tests.kernels.native_builds import builds

    proc = NATIVE_BUILDS.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert sum(line.startswith("ok   ") for line in proc.stdout.splitlines()) == len(builds()), proc.stdout[-3000:]
    for source, defines, isa in builds():
        assert build(source, defines, isa=isa).is_file()


def native(head_dim: int, gqa: int, dtype: torch.dtype, block_size: int):
    kernels = select_kernels("native", "cpu", dtype, head_dim, gqa, block_size)
    assert kernels.name == "native"
    return kernels


def reference(rows, block_size, window=None, softcap=None) -> list[torch.Tensor]:
    return attend(TorchKernels(), rows, block_size, window, dtype=torch.float32, softcap=softcap)


SHAPES = [(64, 1), (64, 3), (80, 2), (80, 5), (96, 4), (96, 7), (128, 6), (128, 8)]  # (head_dim, GQA group)


# every shape on the best path this CPU runs, two on the lower ones (they run the same code over another vec.h)
ISA_SHAPES = [(isa, *shape) for isa in RUNNABLE_ISAS for shape in (SHAPES if isa == BEST_ISA else SHAPES[2:4])]


@needs_native
@pytest.mark.parametrize("isa_name,head_dim,gqa", ISA_SHAPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_native_attention_matches_the_fp32_reference(isa_name, head_dim, gqa, block_size, dtype, monkeypatch):
    monkeypatch.setenv("BATCHJOB_CPU_ISA", isa_name)
    kernels = native(head_dim, gqa, dtype, block_size)
    rows = random_rows(SPEC, 2, gqa, head_dim, dtype, seed=head_dim + gqa)
    # bf16: both see the same rounded inputs; what remains is bf16 output rounding and P in bf16
    tol = 3e-6 if dtype == torch.float32 else 2e-2
    for window in (None, 24):
        out, ref = torch.cat(attend(kernels, rows, block_size, window)).float(), torch.cat(reference(rows, block_size, window))
        assert (out - ref).abs().max().item() < tol, window
    if dtype == torch.bfloat16:  # as accurate as torch's own bf16 attention
        ref = torch.cat(reference(rows, block_size))
        mine = (torch.cat(attend(kernels, rows, block_size)).float() - ref).abs().mean()
        theirs = (torch.cat(attend(TorchKernels(), rows, block_size)).float() - ref).abs().mean()
        assert mine <= theirs * 1.2


@needs_native
@pytest.mark.parametrize("head_dim,gqa", [(64, 3), (256, 2)])  # SmolLM2's shape; Gemma 2's head_dim
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_native_attention_with_a_logit_soft_cap_matches_the_fp32_reference(head_dim, gqa, dtype, isa):
    """Gemma 2's tanh(s / cap) * cap on the scores, for decodes, fresh prompts, continued chunks and prefix hits,
    with and without a sliding window; a row's result still bitwise the same alone. The queries are scaled
    x4 so that the scores go past a cap of 5 (where the tanh bends them) and near Gemma 2's 50."""
    kernels = native(head_dim, gqa, dtype, 16)
    rows = random_rows(SPEC, 2, gqa, head_dim, dtype, seed=head_dim + gqa)
    for r in rows:
        r.q = r.q * 4
    for cap, window in ((5.0, None), (5.0, 24), (50.0, None), (50.0, 24)):
        out, ref = torch.cat(attend(kernels, rows, 16, window, softcap=cap)).float(), torch.cat(reference(rows, 16, window, cap))
        assert (torch.cat(reference(rows, 16, window)) - ref).abs().max() > 0.05  # the cap changes the result
        if dtype == torch.float32:  # a sharper softmax than above: each score's fp32 rounding weighs more
            assert (out - ref).abs().max().item() < 2e-5, (cap, window)
        else:  # the reference's own bf16 run rounds only its output (softmax in fp32); P in bf16 adds a little
            theirs = torch.cat(attend(TorchKernels(), rows, 16, window, softcap=cap)).float()
            assert (out - ref).abs().max().item() < 2e-2, (cap, window)
            assert (out - ref).abs().mean() <= (theirs - ref).abs().mean() * 1.5, (cap, window)
    batched = attend(kernels, rows, 16, 24, softcap=5.0)
    for i in (0, 3, 5, 7):
        assert torch.equal(attend(kernels, [rows[i]], 16, 24, seed=i + 1, softcap=5.0)[0], batched[i]), i


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_native_store_kv_puts_each_token_where_attention_reads_it(dtype, isa):
    """Tokens stored one at a time, in random order, from strided views of a fused projection, give the
    same cache as all stored at once."""
    kernels = native(64, 3, dtype, 16)
    ks, vs = kernels.kv_cache_shapes(6, 16, 2, 64)
    k, v = torch.randn(50, 2, 64).to(dtype), torch.randn(50, 2, 64).to(dtype)
    slots = torch.randperm(96)[:50]
    kc, vc = torch.zeros(ks, dtype=dtype), torch.zeros(vs, dtype=dtype)
    kernels.store_kv(k, v, kc, vc, slots)
    kc1, vc1 = torch.zeros_like(kc), torch.zeros_like(vc)
    fused = torch.cat([k, v], dim=1)  # [T, 2 * Hkv, D]: K and V below are strided views
    for t in random.Random(0).sample(range(50), 50):
        kernels.store_kv(fused[t:t + 1, :2], fused[t:t + 1, 2:], kc1, vc1, slots[t:t + 1])
    assert torch.equal(kc, kc1) and torch.equal(vc, vc1)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_a_rows_attention_is_bitwise_the_same_alone_or_in_any_batch_and_thread_count(dtype, isa):
    rng = random.Random(1)
    spec = [(rng.randint(0, 300), 1) for _ in range(24)] + [(rng.randint(0, 80), rng.randint(2, 40)) for _ in range(8)]
    kernels = native(64, 3, dtype, 16)
    rows = random_rows(spec, 3, 3, 64, dtype)
    batched = attend(kernels, rows, 16)
    threads = torch.get_num_threads()
    try:
        for trial in range(4):
            torch.set_num_threads(1 + trial % 2)
            dec, pre = list(range(24)), list(range(24, 32))
            rng.shuffle(dec)
            rng.shuffle(pre)
            out = attend(kernels, [rows[i] for i in dec + pre], 16, seed=trial + 1)
            for i, o in zip(dec + pre, out):
                assert torch.equal(o, batched[i]), (trial, i)
        for i in (0, 5, 23, 24, 31):
            assert torch.equal(attend(kernels, [rows[i]], 16, seed=9)[0], batched[i]), i
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_a_tokens_attention_is_the_same_decoded_or_in_any_prefill_chunk(dtype, isa):
    """Token p of a 70-token prompt: computed in one chunk, in chunks of 1 (decodes), 16 or 23 tokens
    (extends over the cached prefix), beside other rows or alone. Bitwise the same each time, so
    recompute after preemption, chunked prefill and prefix-cache hits cannot change a row's numbers."""
    kernels = native(64, 3, dtype, 16)
    (full,) = random_rows([(0, 70)], 2, 3, 64, dtype, seed=3)
    others = random_rows([(10, 1), (0, 20)], 2, 3, 64, dtype, seed=4)
    whole = attend(kernels, [full], 16)[0]
    for chunk in (1, 16, 23):
        for start in range(0, 70, chunk):
            n = min(chunk, 70 - start)
            part = Row(start, n, full.k[:start + n], full.v[:start + n], full.q[start:start + n])
            rows = [others[0], part, others[1]] if n == 1 else [others[0], others[1], part]
            out = attend(kernels, rows, 16, seed=start)[1 if n == 1 else 2]
            assert torch.equal(out, whole[start:start + n]), (chunk, start)


def test_triton_needs_cuda_or_the_interpreter_and_native_refuses_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KernelError, match="triton.*cannot run here.*CUDA.*TRITON_INTERPRET=1"):
        select_kernels("triton", "cpu", torch.float32, 64, 1)
    with pytest.raises(KernelError, match="native.*CPU"):
        select_kernels("native", "cuda", torch.float32, 64, 1)
    assert select_kernels("torch", "cpu", torch.float32, 64, 1).name == "torch"


def test_auto_falls_back_to_torch_with_one_line_when_the_compiler_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("BATCHJOB_CACHE_DIR", str(tmp_path / "cache"))  # nothing built here yet
    lines = []
    kernels = select_kernels("auto", "cpu", torch.float32, 48, 2, log=lines.append)
    assert kernels.name == "torch"
    assert len(lines) == 1 and "native kernels unavailable" in lines[0] and "no-such-g++" in lines[0]
    select_kernels("auto", "cpu", torch.float32, 64, 1, log=lines.append)  # another model (a draft), another job
    assert len(lines) == 1  # the notice is said once per process
    with pytest.raises(KernelError, match="native.*cannot run here.*no C\\+\\+ compiler"):
        select_kernels("native", "cpu", torch.float32, 48, 2, log=lines.append)
    with pytest.raises(KernelError, match="block_size 8"):  # an explicit choice never falls back silently
        select_kernels("native", "cpu", torch.float32, 64, 1, block_size=8)


@needs_native
def test_a_job_without_a_compiler_runs_on_the_torch_kernels(monkeypatch, tmp_path, tiny_model_dir):
    from click.testing import CliRunner

    from batchjob.cli.main import main

    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hello"}\n{"prompt": "world"}\n')
    env = {**os.environ, "CXX": "/nonexistent/g++", "BATCHJOB_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "batchjob.cli.main", "run", "--model", str(tiny_model_dir("llama")), "--input",
                          str(src), "--output", str(tmp_path / "out"), "--max-tokens", "3", "--no-progress"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("native kernels unavailable") == 1 and "torch kernels" in out.stdout
    assert "Traceback" not in out.stderr


@needs_native
def test_a_read_only_cache_still_builds_into_a_temporary_folder(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("BATCHJOB_CACHE_DIR", str(blocker / "cache"))  # cannot be created: a file is in the way
    lines = []
    lib = build("paged_attention.cpp", {"HEAD_DIM": 16, "GQA": 1}, log=lines.append)
    assert lib.is_file() and not str(lib).startswith(str(blocker))
    assert any("not writable" in ln for ln in lines)


_BUILD = """
import sys
from batchjob.kernels.native.build import build
print(build("paged_attention.cpp", {"HEAD_DIM": 48, "GQA": 2}))
"""


@needs_native
def test_two_processes_compiling_at_once_both_succeed(tmp_path):
    env = {**os.environ, "BATCHJOB_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1 and Path(paths.pop()).is_file()
    built = [f.name for f in (tmp_path / "kernels").iterdir()]
    assert sum(name.endswith(".so") for name in built) == 1 and not any(name.endswith(".tmp") for name in built)


@needs_native
def test_a_model_s_first_use_compiles_everything_it_needs_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHJOB_CACHE_DIR", str(tmp_path))
    lines = []
    kernels = select_kernels("native", "cpu", torch.float32, 64, 3, log=lines.append)
    assert kernels.name == "native" and kernels.reference_ops() == []  # every op compiled: none borrowed
    assert len(lines) == 1 and "paged_attention gqa 3 head_dim 64; fused" in lines[0], lines
    select_kernels("native", "cpu", torch.float32, 64, 3, log=lines.append)
    assert len(lines) == 1  # cached: silent


@needs_native
def test_the_first_build_says_so_in_one_line_and_the_next_is_silent(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHJOB_CACHE_DIR", str(tmp_path))
    lines = []
    build("paged_attention.cpp", {"HEAD_DIM": 32, "GQA": 1}, log=lines.append)
    assert len(lines) == 1 and re.match(r"compiled (AVX-512|AVX2|generic C\+\+) kernels for this CPU", lines[0]), lines
    assert " s, cached in " in lines[0]
    build("paged_attention.cpp", {"HEAD_DIM": 32, "GQA": 1}, log=lines.append)
    assert len(lines) == 1


def test_the_cache_key_covers_the_cpu_and_the_compiler(monkeypatch, tmp_path):
    """A build made on one CPU is never loaded on another: its flags are part of the file name's key."""
    monkeypatch.setenv("BATCHJOB_CACHE_DIR", str(tmp_path))
    first = build("paged_attention.cpp", {"HEAD_DIM": 16, "GQA": 1})
    model, flags = cpu_identity()
    other = next(f for f in ("avx512_fp16", "amx_tile", "avx10_1", "sha512") if f not in flags)  # one this CPU lacks
    monkeypatch.setattr("batchjob.kernels.native.build.cpu_identity", lambda: (model, flags | {other}))
    assert build("paged_attention.cpp", {"HEAD_DIM": 16, "GQA": 1}) != first


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows,n", [(1, 576), (7, 100), (64, 64), (33, 1000)])
def test_fused_norms_match_the_reference(dtype, rows, n, isa):
    kernels, ref = native(64, 1, dtype, 16), TorchKernels()
    g = torch.Generator().manual_seed(n)
    x, h = (torch.randn(rows, n, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype)
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # bf16: one ulp
    torch.testing.assert_close(kernels.rms_norm(h, w, 1e-5), ref.rms_norm(h, w, 1e-5), **tol)
    h1, h2 = h.clone(), h.clone()
    out1, out2 = kernels.add_rms_norm(x, h1, w, 1e-6), ref.add_rms_norm(x, h2, w, 1e-6)
    assert torch.equal(h1, h2)  # the residual add is the same rounding
    torch.testing.assert_close(out1, out2, **tol)
    strided = torch.cat([x, x], dim=1)[:, :n]  # rows of a wider tensor
    h3 = h.clone()
    assert torch.equal(kernels.add_rms_norm(strided, h3, w, 1e-6), out1) and torch.equal(h3, h1)


# the rotary kernel takes any head counts; a kernel set also builds attention for its (head_dim, GQA group), so the
# rotary tests take groups other tests build (a group of their own: a build more per head_dim and path)
ROTARY_GQA = {16: 1, 64: 1, 80: 2, 128: 8}


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
def test_fused_rotary_is_bitwise_the_reference(dtype, head_dim, isa):
    from batchjob.kernels import RotaryEmbedding

    kernels = native(head_dim, ROTARY_GQA[head_dim], dtype, 16)
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None, dtype)
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(9, 5 * head_dim, generator=g).to(dtype)  # 3 query heads, 1 KV head, then V
    positions = torch.tensor([0, 1, 5, 17, 100, 255, 256, 400, 511])
    q, k = qkv[:, :3 * head_dim].view(9, 3, head_dim), qkv[:, 3 * head_dim:4 * head_dim].view(9, 1, head_dim)
    want = TorchKernels().rotary(q.clone(), k.clone(), TorchKernels().prepare_rotary(rope, positions))
    got = kernels.rotary(q, k, kernels.prepare_rotary(rope, positions))  # in place, on views of the QKV output
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(qkv[:, :3 * head_dim].view(9, 3, head_dim), want[0])


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows,n", [(1, 1536), (5, 100), (64, 128)])
def test_fused_silu_mul_matches_the_reference(dtype, rows, n, isa):
    kernels = native(64, 1, dtype, 16)
    gate_up = (4 * torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(n))).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's range ends
    want = TorchKernels().silu_mul(gate_up)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(kernels.silu_mul(gate_up), want, **tol)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows,n", [(1, 9216), (5, 100), (64, 128)])  # 9216: Gemma 2 2B's MLP
def test_fused_gelu_tanh_mul_matches_the_reference(dtype, rows, n, isa):
    kernels = native(64, 1, dtype, 16)
    gate_up = (4 * torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(n))).to(dtype)
    gate_up[0, :8] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -5.0, 5.0, float("inf"), float("-inf")])
    want = TorchKernels().gelu_tanh_mul(gate_up)
    # fp32: where gate < -2, 1 + tanh cancels, and torch's own result is good only to ~1e-7 |gate * up|
    tol = dict(rtol=2e-6, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(kernels.gelu_tanh_mul(gate_up), want, equal_nan=True, **tol)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows,vocab", [(1, 256000), (3, 1001), (40, 49152)])
def test_fused_softcap_matches_the_reference(dtype, rows, vocab, isa):
    """Gemma 2's final logit soft-cap (30): a new tensor of x's dtype, NaN and infinities as torch has them,
    the range of the tanh's two branches and a tail shorter than a vector."""
    kernels = native(64, 1, dtype, 16)
    x = (20 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab))).to(dtype)
    x[0, :9] = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-30, 29.9, 30.0, 300.0])
    before = x.clone()
    got, want = kernels.softcap(x, 30.0), TorchKernels().softcap(x, 30.0)
    assert got.dtype == dtype and torch.equal(x.nan_to_num(), before.nan_to_num())
    # fp32: a few ulps (another tanh); bf16: both round each op to bf16, so they differ by one bf16 ulp at most
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(got, want, equal_nan=True, **tol)
    assert torch.equal(got[0, :5].nan_to_num(), want[0, :5].nan_to_num())  # NaN, +-30, +-0 exactly
    assert torch.equal(got[0, :5].signbit(), want[0, :5].signbit())


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("vocab", [5, 16, 400, 32000, 49152, 1001])
def test_native_argmax_is_torch_argmax(dtype, vocab, isa):
    kernels = native(64, 1, dtype, 16)
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g).to(dtype)
    x[1, :] = x[1, 0]  # all equal: the first
    x[2, vocab // 2] = x[2, vocab - 1] = 100.0  # a tie: the first of them
    x[3, :] = float("-inf")
    x[4, min(7, vocab - 1)] = float("nan")  # NaN counts as the maximum, the first one
    x[5, vocab - 1] = 1000.0  # in the tail
    x[6, :] = float("-inf")
    x[6, vocab - 1] = float("nan")
    assert torch.equal(kernels.argmax(x), x.argmax(dim=-1))
    assert torch.equal(kernels.argmax(x[:1]), x[:1].argmax(dim=-1))


@needs_native
def test_every_instruction_set_path_gives_the_same_bits(monkeypatch):
    """AVX-512, AVX2 and generic C++ run the same operations in the same order over 16 lanes (vec.h): for the same
    inputs their fp32 attention and fused ops are bitwise equal (bf16 attention too, except on AVX512-BF16 hardware,
    whose dot-product instruction rounds its own way)."""
    if len(RUNNABLE_ISAS) < 2:
        pytest.skip("one instruction-set path runs here")
    rows = random_rows(SPEC, 2, 3, 64, torch.float32, seed=5)
    g = torch.Generator().manual_seed(0)
    x, h = torch.randn(9, 576, generator=g), torch.randn(9, 576, generator=g)
    gate_up = 4 * torch.randn(9, 2 * 576, generator=g)
    results = {}
    for isa_name in RUNNABLE_ISAS:
        monkeypatch.setenv("BATCHJOB_CPU_ISA", isa_name)
        got = []
        for dtype in DTYPES:
            k = native(64, 3, dtype, 16)
            assert k.isa == isa_name
            if dtype == torch.float32 or not HAS_BF16:
                got += [*attend(k, rows, 16, window=24, dtype=dtype), *attend(k, rows, 16, softcap=5.0, dtype=dtype)]
            got += [k.add_rms_norm(x.to(dtype), h.to(dtype).clone(), torch.ones(576, dtype=dtype), 1e-6),
                    k.silu_mul(gate_up.to(dtype)), k.gelu_tanh_mul(gate_up.to(dtype)), k.softcap(gate_up.to(dtype), 3.0),
                    k.argmax(gate_up.to(dtype))]
        results[isa_name] = got
    first, *others = RUNNABLE_ISAS
    for other in others:
        for i, (a, b) in enumerate(zip(results[first], results[other])):
            assert torch.equal(a, b), (first, other, i)


@pytest.mark.skipif(not isa_runs_here("avx2") and not isa_runs_here("avx512"), reason="not an x86 CPU")
@pytest.mark.parametrize("source,defines", [("paged_attention.cpp", {"HEAD_DIM": 64, "GQA": 3}), ("fused.cpp", {})])
def test_the_avx512_path_compiles_on_any_x86(source, defines):
    """The AVX-512 path is at least compiled where the CPU cannot run it (and the other paths everywhere)."""
    compile_every_path(source, defines)


def test_a_forced_path_this_cpu_lacks_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("BATCHJOB_CPU_ISA", "sse9")
    with pytest.raises(KernelError, match="BATCHJOB_CPU_ISA='sse9' is not one of auto, avx512, avx2, generic"):
        select_kernels("native", "cpu", torch.float32, 64, 1)
    if isa_runs_here("avx512"):
        return
    monkeypatch.setenv("BATCHJOB_CPU_ISA", "avx512")
    with pytest.raises(KernelError, match="BATCHJOB_CPU_ISA=avx512: this CPU lacks avx512f"):
        select_kernels("native", "cpu", torch.float32, 64, 1)
    lines = []
    assert select_kernels("auto", "cpu", torch.float32, 64, 1, log=lines.append).name == "torch"
    assert len(lines) == 1 and "this CPU lacks avx512f" in lines[0]
