"""The scale rows' harness (issue 46, bench/scale.py and bench/scale_models.py): the models' shapes, the sharded bf16
HF folder (loadable by batchjob), peak-RSS measurement, llama-batched-bench's table; and, where llama.cpp is built
(`make bench-llama-cpp`; CI has none), the whole quick pipeline: build, convert, quantize, both runners."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from batchjob.bench import cpu_peers, scale, scale_models


def test_shapes_are_the_real_models():
    one, four, eight = (scale_models.SHAPES[n] for n in ("1b", "4b", "8b"))
    assert 1.0e9 < one.params < 1.1e9  # Llama-3.2-1B with SmolLM2's 49,152-token vocabulary: 1.07 B
    assert (one.hidden, one.layers, one.heads, one.kv_heads, one.head_dim, one.intermediate, one.tied) == \
        (2048, 16, 32, 8, 64, 8192, True)
    assert (four.hidden, four.layers, four.head_dim, four.intermediate) == (2560, 36, 128, 9728)
    assert (eight.hidden, eight.layers, eight.intermediate, eight.tied) == (4096, 32, 14336, False)
    assert 7.2e9 < eight.params < 7.5e9
    names = [n for n, _ in eight.tensors()]
    assert names[-1] == "lm_head.weight" and "lm_head.weight" not in [n for n, _ in one.tensors()]


def test_quick_model_is_a_sharded_bf16_folder_batchjob_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(scale_models, "SHARD_BYTES", 8 << 20)  # several shards from the tiny model
    shape = scale_models.SHAPES["quick"]
    hf = tmp_path / "quick" / "hf"
    scale_models.write_hf_folder(shape, hf, tmp_path)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in hf.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == 2 * shape.params
    assert not list(tmp_path.glob("quick/.*tmp"))  # written under a temporary name, renamed when complete

    from batchjob.models.loader import load_model

    loaded = load_model(str(hf), dtype=torch.bfloat16)
    assert loaded.config.hidden_size == 256 and loaded.config.num_layers == 2 and loaded.config.tie_word_embeddings
    assert loaded.tokenizer.vocab_size == 49152 and loaded.tokenizer.eos_token_ids == [2]
    w = loaded.weights["model.layers.1.mlp.down_proj.weight"].float()
    assert w.shape == (256, 512) and abs(w.std().item() - 0.02) < 0.002
    assert torch.all(loaded.weights["model.norm.weight"] == 1)
    # the same files every time: each tensor from its own seeded generator
    again = tmp_path / "again" / "hf"
    scale_models.write_hf_folder(shape, again, tmp_path)
    assert (again / shards[0]).read_bytes() == (hf / shards[0]).read_bytes()


@pytest.mark.parametrize("with_time", [True, False])
def test_peak_rss_of_a_child(monkeypatch, with_time):
    if not with_time:
        monkeypatch.setattr(cpu_peers, "TIME", "/nonexistent/time")  # the Python wrapper's RUSAGE_CHILDREN instead
    elif not Path(cpu_peers.TIME).is_file():
        pytest.skip("no /usr/bin/time here")
    out, wall, peak_kib = cpu_peers.run_measured([sys.executable, "-c", "x = bytearray(300 << 20); x[::4096] = b'1' * len(x[::4096])"], 60)
    assert out.returncode == 0 and wall > 0
    assert 300 << 10 < peak_kib < 2 << 20


def test_llama_batched_bench_table_is_read(tmp_path):
    """The result row of llama-batched-bench's table, and its -c sized for rows x (prompt + gen)."""
    fake = tmp_path / "llama-batched-bench"
    fake.write_text("#!/bin/sh\necho \"$@\" > " + str(tmp_path / "args") + "\n"
                    "echo '|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |'\n"
                    "echo '|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|'\n"
                    "echo '|   128 |     64 |   32 |   6144 |   20.000 |   204.80 |   29.800 |    68.72 |   49.800 |   123.37 |'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    r = cpu_peers.run_llama_cpp(fake, "m.gguf", 2, 30, rows=32, prompt=128, gen=64)
    assert (r["job_s"], r["prefill_s"], r["decode_tok_s"]) == (49.8, 20.0, 68.72)
    assert r["peak_rss_mib"] and r["peak_rss_mib"] > 0
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-c") + 1] == str(32 * 192) and args[args.index("-npl") + 1] == "32"


def test_rows_compare_and_print():
    row = {"model": "1b", "format": "Q4_K_M", "systems": [
        {"system": "batchjob", "job_s": 20.0, "process_s": 30.0, "peak_rss_mib": 1600.0, "dtype": "bfloat16",
         "kernels": "native", "load_s": 5.0, "single_row": {"decode_tok_s": 30.0}},
        {"system": "batchjob --quantization none", "error": "RuntimeError: boom"},
        {"system": "llama.cpp", "job_s": 50.0, "process_s": 51.0, "peak_rss_mib": 1400.0, "single_row": {"decode_tok_s": 20.0}}]}
    scale._compare(row, {"native_path": "avx512"})
    bj = row["systems"][0]
    assert bj["speedup_job"] == 2.5 and round(bj["memory_ratio"], 3) == round(1600 / 1400, 3)
    assert bj["single_row_decode_ratio"] == 1.5
    assert [t["met"] for t in row["targets"]] == [True, True]
    report = {"machine": {"cpu": "x", "native_path": "avx512"}, "workload": "w", "threads": 2, "rows": [row],
              "skipped": {"8b": "10 GiB of memory available"}}
    text = scale.text(report)
    assert "2.50x" in text and "boom" in text and "8b: skipped: 10 GiB" in text


def test_whole_quick_pipeline(tmp_path):
    why = scale_models.missing_tools() or (None if cpu_peers.llama_cpp_binary() else "llama-batched-bench not built")
    if why:
        pytest.skip(f"needs llama.cpp's tools (`make bench-llama-cpp`): {why}")
    report = scale.measure(["quick"], formats=("Q4_0",), rows=2, prompt=16, gen=8, single=False, cache=tmp_path,
                           timeout=300, log=lambda m: None)
    assert not report["skipped"], report["skipped"]
    (row,) = report["rows"]
    assert row["format"] == "Q4_0" and row["gguf_bytes"] > 0
    by = {s["system"]: s for s in row["systems"]}
    assert set(by) == {"batchjob", "llama.cpp"} and not any("error" in s for s in by.values()), by
    assert by["batchjob"]["peak_rss_mib"] > by["batchjob"]["load_peak_rss_mib"] * 0.5 and by["llama.cpp"]["job_s"] > 0
    assert "speedup_job" in by["batchjob"] and "memory_ratio" in by["batchjob"]


def test_a_timed_out_child_is_killed_with_its_wrapper(tmp_path):
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    with pytest.raises(subprocess.TimeoutExpired):
        cpu_peers.run_measured([sys.executable, "-c", code], 8)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # killed; reaped by init a moment later (a zombie meanwhile)
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in "ZX":
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the child {pid} still runs")


def test_a_model_that_does_not_fit_is_skipped_saying_why(tmp_path, monkeypatch):
    eight = scale_models.SHAPES["8b"]
    monkeypatch.setattr(scale_models.shutil, "disk_usage", lambda _: type("U", (), {"free": 1 << 50})())
    monkeypatch.setattr(scale_models, "available_memory", lambda: 8 << 30)
    assert "memory available" in scale_models.room(eight, scale_models.FORMATS, tmp_path)
    monkeypatch.setattr(scale_models, "available_memory", lambda: 64 << 30)
    monkeypatch.setattr(scale_models.shutil, "disk_usage", lambda _: type("U", (), {"free": 20 << 30})())
    assert "free on the disk" in scale_models.room(eight, scale_models.FORMATS, tmp_path)
    assert scale_models.room(scale_models.SHAPES["quick"], scale_models.FORMATS, tmp_path) is None
