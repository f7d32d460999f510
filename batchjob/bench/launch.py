"""Starts one bench process per (system, model) and collects its `BENCH_RESULT` lines: a worker in this
venv for batchjob and HF transformers, `vllm_worker.py` in `.venv-vllm` for vLLM."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batchjob.bench.models import ModelSpec
from batchjob.bench.workloads import make

MARK = "BENCH_RESULT "
VLLM_VENV = Path(".venv-vllm")


def vllm_python() -> Path | None:
    py = VLLM_VENV / "bin" / "python"
    return py if py.is_file() else None


def _collect(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[list[dict], str | None]:
    """Runs cmd; returns its results and, when it failed, why (the tail of its stderr)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        results = [json.loads(line[len(MARK):]) for line in out.splitlines() if line.startswith(MARK)]
        return results, f"timed out after {timeout:.0f} s"
    results = [json.loads(line[len(MARK):]) for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-3:]
        return results, f"exit {proc.returncode}: " + " | ".join(tail)[-600:]
    return results, None


def run_json_module(module: str, args: list[str], timeout: float) -> tuple[object | None, str | None]:
    """`python -m module *args --json FILE` in its own process: what it wrote to FILE, or None and why."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        try:
            proc = subprocess.run([sys.executable, "-m", module, *args, "--json", f.name], capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout:.0f} s"
        if proc.returncode != 0:
            tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-3:]
            return None, f"exit {proc.returncode}: " + " | ".join(tail)[-600:]
        return json.loads(Path(f.name).read_text()), None


def run_system(system: str, spec: ModelSpec, workloads: list[str], rows: int = 0, timeout: float = 3600,
               threads: int = 0) -> tuple[list[dict], str | None]:
    model = str(Path(spec.path).resolve())
    if system == "vllm":
        return run_vllm(spec, workloads, rows, timeout)
    cmd = [sys.executable, "-m", "batchjob.bench.worker", "--system", system, "--model", model,
           "--workloads", ",".join(workloads), "--rows", str(rows), "--spawned-at", repr(time.time())]
    if threads:
        cmd += ["--threads", str(threads)]
    results, err = _collect(cmd, timeout)
    for r in results:
        r["model"] = spec.name
    return results, err


def run_vllm(spec: ModelSpec, workloads: list[str], rows: int, timeout: float) -> tuple[list[dict], str | None]:
    py = vllm_python()
    if py is None:
        return [], "skipped: run make bench-peers"
    data = {}
    for name in workloads:
        wl = make(name)
        if rows:
            wl = wl.head(rows)
        data[name] = [[r.prompt, r.max_tokens] for r in wl.rows]
    longest = max(len(p) + g for rows_ in data.values() for p, g in rows_)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": str(Path(spec.path).resolve()), "workloads": data, "dtype": "bfloat16",
                   "max_model_len": max(1024, -(-longest // 256) * 256), "spawned_at": time.time()}, f)
        spec_file = f.name
    try:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
        cmd = [str(py), str(Path(__file__).with_name("vllm_worker.py")), spec_file]
        results, err = _collect(cmd, timeout, env=env)
    finally:
        os.unlink(spec_file)
    for r in results:
        r["model"] = spec.name
    return results, err


def run_profile(spec: ModelSpec, kernels: str, warm_steps: int, threads: int = 0,
                timeout: float = 3600) -> tuple[dict | None, str | None]:
    """One decode-step profile (bench/decode_profile.py) in its own process."""
    from batchjob.bench.decode_profile import MARK as PROFILE_MARK

    cmd = [sys.executable, "-m", "batchjob.bench.decode_profile", "--model", str(Path(spec.path).resolve()), "--kernels", kernels,
           "--warm-steps", str(warm_steps)]
    if threads:
        cmd += ["--threads", str(threads)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    for line in proc.stdout.splitlines():
        if line.startswith(PROFILE_MARK):
            return json.loads(line[len(PROFILE_MARK):]), None
    tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-3:]
    return None, f"exit {proc.returncode}: " + " | ".join(tail)[-600:]
