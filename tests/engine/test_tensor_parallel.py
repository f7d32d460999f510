"""`--tensor-parallel N` (models/tensor_parallel.py, engine/worker/tensor_parallel.py, engine/tensor_parallel.py): the
model split over N processes in one gloo group, each reading and holding only its slice (heads, KV heads, MLP
columns and rows, vocabulary); rank 0's scheduler drives every rank, one all-reduce per attention and MLP block summed
in rank order. Greedy text equals the single process's on three families; bf16 rows alone = batched under it; each
rank holds about half the weights and KV; a rank killed mid-job stops the job, and the rerun finishes it exactly once.

The runs are processes of their own: a process that leads a tensor-parallel group is pinned to its rank's cores."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.errors import ConfigError
from batchjob.io.parts import read_results
from batchjob.job.options.keywords import job_config
from batchjob.models.config import UnsupportedModelError
from batchjob.models.loader import check_split, load_model
from batchjob.models.tensor_parallel import TensorShard

HANG_GUARD_S = 600  # a broken run must not hang the suite; never a timing assertion
FAMILIES = ("llama", "gemma2", "phi3")  # separate q/k/v; Gemma's four norms, soft-caps and tied vocabulary; fused QKV


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchjob", "run", *args], capture_output=True, text=True,
                          timeout=HANG_GUARD_S, **kw)


def _run_here(args: list[str]) -> None:
    """The single-process reference, in this process (the split runs need processes of their own: one torch import
    fewer a comparison)."""
    result = CliRunner().invoke(main, ["run", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def _prompts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"Row {i}: " + "count the words " * (i % 5)}) + "\n" for i in range(n)))
    return path


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_each_rank_reads_its_slice_and_the_slices_make_the_model(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    whole = load_model(path)
    c = whole.config
    ranks = [load_model(path, rank_of=(r, 2)) for r in range(2)]
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    for r, part in enumerate(ranks):
        assert part.shard.shard_config().num_heads == c.num_heads // 2
        assert part.weights["model.embed_tokens.weight"].shape == (c.vocab_size // 2, c.hidden_size)
        assert torch.equal(part.weights["model.norm.weight"], whole.weights["model.norm.weight"])  # norms: whole
    if arch == "llama":
        q_rows = torch.cat([p.weights[a + "q_proj.weight"] for p in ranks])
        k_rows = torch.cat([p.weights[a + "k_proj.weight"] for p in ranks])
        gate = torch.cat([p.weights[m + "gate_proj.weight"] for p in ranks])
        assert torch.equal(q_rows, whole.weights[a + "q_proj.weight"])
        assert torch.equal(k_rows, whole.weights[a + "k_proj.weight"])
        assert torch.equal(gate, whole.weights[m + "gate_proj.weight"])
    else:  # Phi-3's fused tensors: each rank's q, k and v rows (and gate and up) out of one tensor
        fused = whole.weights[a + "qkv_proj.weight"]
        parts = [p.weights[a + "qkv_proj.weight"] for p in ranks]
        assert parts[0].shape[0] == (q + 2 * kv) // 2
        half_q, half_kv = q // 2, kv // 2
        assert torch.equal(torch.cat([p[:half_q] for p in parts]), fused[:q])
        assert torch.equal(torch.cat([p[half_q:half_q + half_kv] for p in parts]), fused[q:q + kv])
        assert torch.equal(torch.cat([p[half_q + half_kv:] for p in parts]), fused[q + kv:])
        gate_up = whole.weights[m + "gate_up_proj.weight"]
        halves = [p.weights[m + "gate_up_proj.weight"] for p in ranks]
        assert torch.equal(torch.cat([h[:inter // 2] for h in halves]), gate_up[:inter])
        assert torch.equal(torch.cat([h[inter // 2:] for h in halves]), gate_up[inter:])
    o = torch.cat([p.weights[a + "o_proj.weight"] for p in ranks], dim=1)  # row-parallel: columns split
    down = torch.cat([p.weights[m + "down_proj.weight"] for p in ranks], dim=1)
    assert torch.equal(o, whole.weights[a + "o_proj.weight"]) and torch.equal(down, whole.weights[m + "down_proj.weight"])
    sizes = [sum(t.numel() for t in p.weights.values()) for p in (whole, *ranks)]
    assert sizes[1] == sizes[2] and 0.45 < sizes[1] / sizes[0] < 0.55  # half, but the norms each rank keeps whole


def test_kv_heads_split_or_replicated_and_the_vocabulary_padded(tiny_model_dir):
    c = load_model(tiny_model_dir("llama")).config  # 4 heads, 2 KV heads, vocabulary 400
    two = [TensorShard.of(c, r, 2) for r in range(2)]
    assert [(s.kv_heads, s.kv_head_start) for s in two] == [(1, 0), (1, 1)]
    four = [TensorShard.of(c, r, 4) for r in range(4)]  # fewer KV heads than ranks: replicated, as vLLM does
    assert [(s.heads, s.kv_heads, s.kv_head_start) for s in four] == [(1, 1, 0), (1, 1, 0), (1, 1, 1), (1, 1, 1)]
    import dataclasses
    odd = dataclasses.replace(c, vocab_size=401)
    shard = TensorShard.of(odd, 1, 2)
    t = shard.take("model.embed_tokens.weight", (401, 4), lambda index: torch.ones(401, 4)[index])
    assert shard.vocab_rows == 201 and t.shape == (201, 4) and t[-1].abs().sum() == 0  # the padding row


def test_what_does_not_split_is_refused_by_name(tiny_model_dir, tiny_gguf_path):
    with pytest.raises(UnsupportedModelError, match="not implemented for architecture 'olmo2'"):
        check_split(tiny_model_dir("olmo2"), 2)
    with pytest.raises(UnsupportedModelError, match="does not divide its attention heads 4"):
        check_split(tiny_model_dir("llama"), 3)
    with pytest.raises(UnsupportedModelError, match="GGUF file is not implemented"):
        check_split(tiny_gguf_path("llama"), 2)
    for extra, what in (({"quantization": "int8"}, "quantization int8"), ({"speculative": "draft", "draft_model": "x"},
                                                                          "speculative draft")):
        with pytest.raises(ConfigError, match=f"tensor_parallel: {what} under tensor parallel is not implemented"):
            job_config({"model": "m", "input": "x.jsonl", "tensor_parallel": 2, **extra})
    with pytest.raises(ConfigError, match="tensor_parallel: must be >= 1"):
        job_config({"model": "m", "input": "x.jsonl", "tensor_parallel": 0})


def test_data_parallel_with_tensor_parallel_is_refused_before_any_rank_starts(tmp_path, tiny_model_dir):
    done = _run(["--model", str(tiny_model_dir("llama")), "--input", str(_prompts(tmp_path / "in.jsonl", 2)), "--output",
                 str(tmp_path / "out"), "--data-parallel", "2", "--tensor-parallel", "2"])
    assert done.returncode == 2
    assert "--data-parallel with --tensor-parallel is not implemented yet" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch", FAMILIES)
def test_two_ranks_write_the_single_processs_greedy_text(tmp_path, tiny_model_dir, arch):
    src = _prompts(tmp_path / "in.jsonl", 12)
    args = ["--model", str(tiny_model_dir(arch)), "--input", str(src), "--max-tokens", "12", "--ignore-eos",
            "--dtype", "float32", "--no-progress"]
    _run_here([*args, "--output", str(tmp_path / "one")])
    split = _run([*args, "--output", str(tmp_path / "tp"), "--tensor-parallel", "2"])
    assert split.returncode == 0, split.stderr
    assert "tensor parallel over 2 ranks; weights" in split.stderr and "per rank" in split.stderr
    one, tp = read_results(tmp_path / "one").to_pylist(), read_results(tmp_path / "tp").to_pylist()
    assert [r["generated_text"] for r in tp] == [r["generated_text"] for r in one]
    assert all(r["completion_tokens"] == 12 for r in tp)


SCRIPT = """
import json, sys
from batchjob.api import LLM
path, out = sys.argv[1], sys.argv[2]
prompts = ["Row %d: " % i + "count the words " * (i % 4) for i in range(6)]
one = LLM(path, max_tokens=10, ignore_eos=True, dtype="bfloat16")
one_bytes = (sum(one.engine.model.weight_memory().values()), one.engine.kv_pool.nbytes)
del one
tp = LLM(path, max_tokens=10, ignore_eos=True, dtype="bfloat16", tensor_parallel=2)
batched = [r.text for r in tp.generate(prompts)]
alone = [tp.generate([p])[0].text for p in prompts]
json.dump({"batched": batched, "alone": alone, "one": one_bytes,
           "rank": (sum(tp.engine.model.weight_memory().values()), tp.engine.kv_pool.nbytes)}, open(out, "w"))
"""


def test_bf16_rows_alone_equal_batched_and_a_rank_holds_half_the_weights_and_kv(tmp_path, tiny_model_dir):
    out = tmp_path / "got.json"
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(tiny_model_dir("llama")), str(out)],
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr
    got = json.loads(out.read_text())
    assert got["alone"] == got["batched"]
    (weights, kv), (rank_weights, rank_kv) = got["one"], got["rank"]
    assert 0.45 < rank_weights / weights < 0.55  # the norms stay whole on each rank
    assert rank_kv * 2 == kv  # its KV heads' blocks: the same number of blocks, half the heads


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_a_killed_rank_stops_the_job_and_the_rerun_finishes_it_once(tmp_path, tiny_model_dir):
    path = tiny_model_dir("llama", max_positions=1024)
    for rows in (48, 192, 768):  # more rows when the job ended before the kill reached it (a fast machine)
        src = _prompts(tmp_path / f"in-{rows}.jsonl", rows)
        args = ["--model", str(path), "--input", str(src), "--max-tokens", "48", "--ignore-eos", "--dtype", "float32",
                "--no-progress", "--part-rows", "4", "--max-num-seqs", "8"]
        out = tmp_path / f"tp-{rows}"
        job = subprocess.Popen([sys.executable, "-m", "batchjob", "run", *args, "--output", str(out),
                                "--tensor-parallel", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        killed, deadline = None, time.monotonic() + HANG_GUARD_S
        while job.poll() is None and time.monotonic() < deadline:
            ranks = _children(job.pid)
            if ranks and any(out.glob("part-*.arrow")):  # mid-job: rows committed
                os.kill(ranks[0], signal.SIGKILL)
                killed = ranks[0]
                break
            time.sleep(0.05)
        _, stderr = job.communicate(timeout=HANG_GUARD_S)
        if killed is not None and job.returncode != 0:
            break
    else:
        pytest.fail("every job ended before the kill reached it")
    assert job.returncode == 1
    assert "tensor-parallel rank 1 ended (killed by signal 9)" in stderr and "rerun the same command" in stderr
    rerun = _run([*args, "--output", str(out), "--tensor-parallel", "2"])
    assert rerun.returncode == 0, rerun.stderr
    assert "resuming" in rerun.stderr
    _run_here([*args, "--output", str(tmp_path / "one")])
    got, want = read_results(out).to_pylist(), read_results(tmp_path / "one").to_pylist()
    assert [r["row_index"] for r in got] == list(range(rows))  # every row once
    assert [r["generated_text"] for r in got] == [r["generated_text"] for r in want]
