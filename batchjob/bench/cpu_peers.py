"""batchjob vs llama.cpp on this CPU, side by side (issue 31): 64 rows x (128 prompt + 128 generated token ids, EOS
ignored) on the embedded SmolLM2-135M, the same Q4_1 GGUF for both. batchjob runs its default (the dtype and
kernels it picks for this CPU) and `--quantization int8`; llama.cpp runs `llama-batched-bench` built for this CPU
(`make bench-llama-cpp`: its own vendored tree from the llama-cpp-python sdist, `-DGGML_NATIVE=ON`).

Also the machine's ceilings, measured here: the weight-matmul rate on SmolLM2's shapes (fp32 through oneDNN, the
int8 native kernel), the read bandwidth, and the share of each that prefill and a 64-row decode step reach; the
CPU's instruction-set flags go with the results (numbers from an AVX2 machine and an AVX-512 one differ).

`python -m batchjob.bench.cpu_peers [--json FILE]` (`make bench` runs it; `--no-cpu-peers` skips it)."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from batchjob.bench.paths import CACHE

ROWS, PROMPT, GEN = 64, 128, 128
LLAMA_CPP_DIR = CACHE / "llama.cpp"  # `make bench-llama-cpp` builds here
TIME = "/usr/bin/time"  # GNU time: a process's peak RSS (-f %M)


def llama_cpp_tool(name: str, env: str) -> Path | None:
    """A llama.cpp program: the path in $`env`, else the one `make bench-llama-cpp` built; None when neither is there."""
    given = os.environ.get(env)
    for p in ([Path(given)] if given else []) + [LLAMA_CPP_DIR / "build/bin" / name]:
        if p.is_file():
            return p
    return None


def llama_cpp_binary() -> Path | None:
    return llama_cpp_tool("llama-batched-bench", "LLAMA_BATCHED_BENCH")


def run_measured(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float, int | None]:
    """Runs cmd as its own process group: (its result, wall seconds, its peak RSS in KiB). The peak is
    `/usr/bin/time -f %M`'s where that exists, else the children's ru_maxrss seen by a Python wrapper that runs
    cmd alone (RUSAGE_CHILDREN in this process would be the largest of every child run so far). On a timeout the
    whole group is killed (nothing is left running) and subprocess.TimeoutExpired raised; so it is on anything else
    that stops the wait (Ctrl-C, a SIGTERM turned into SystemExit)."""
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        if os.path.exists(TIME):
            wrapped = [TIME, "-f", "%M", "-o", rss.name, *cmd]
        else:
            wrapped = [sys.executable, "-c", _RSS_WRAPPER, rss.name, *cmd]
        t0 = time.perf_counter()
        proc = subprocess.Popen(wrapped, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        wall = time.perf_counter() - t0
        lines = [ln for ln in Path(rss.name).read_text().splitlines() if ln.strip()]
    peak = int(lines[-1]) if lines and lines[-1].strip().isdigit() else None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), wall, peak


_RSS_WRAPPER = """import resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
open(sys.argv[1], "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(rc if rc >= 0 else 128 - rc)"""


def run_llama_cpp(binary: Path, gguf: str, threads: int, timeout: float, rows: int = ROWS, prompt: int = PROMPT,
                  gen: int = GEN) -> dict:
    """`llama-batched-bench` on `rows` sequences of `prompt` + `gen` tokens: its prompt and generation rates, the
    job's time (its T column), the whole process's and its peak RSS."""
    cmd = [str(binary), "-m", gguf, "-c", str(rows * (prompt + gen)), "-b", "2048", "-ub", "512", "-npp", str(prompt),
           "-ntg", str(gen), "-npl", str(rows), "-t", str(threads), "-tb", str(threads)]
    out, process_s, peak_kib = run_measured(cmd, timeout)
    if out.returncode < 0 or out.returncode > 128:  # seen on an AVX-512 VM with AMX flags: its AMX matmul segfaults
        sig = -out.returncode if out.returncode < 0 else out.returncode - 128  # (-DGGML_AMX_*=OFF avoids it)
        raise RuntimeError(f"llama-batched-bench was killed by {signal.Signals(sig).name} "
                           f"({(out.stderr.strip().splitlines() or ['no output'])[-1]!r:.120})")
    if out.returncode != 0:
        raise RuntimeError(f"llama-batched-bench exit {out.returncode}: {out.stderr.strip().splitlines()[-1:]}")
    table = [ln for ln in out.stdout.splitlines() if re.match(r"\|\s*\d+\s*\|", ln)]
    if not table:  # e.g. -c too small for rows x (prompt + gen): it prints no row
        raise RuntimeError(f"llama-batched-bench printed no result row: {out.stderr.strip().splitlines()[-1:]}")
    cells = [float(c) for c in table[-1].strip("|").split("|")]
    pp, tg, b, n_kv, t_pp, s_pp, t_tg, s_tg, t, s = cells
    return {"system": "llama.cpp", "job_s": t, "process_s": process_s, "prefill_s": t_pp, "prefill_tok_s": s_pp,
            "decode_s": t_tg, "decode_tok_s": s_tg, "threads": threads,
            "peak_rss_mib": peak_kib / 1024 if peak_kib else None, "command": " ".join(cmd[1:])}


def run_batchjob(quantization: str, threads: int, timeout: float) -> dict:
    """One worker process (`--worker`): model load, then the job on the engine, timed apart."""
    with_json = Path(f"/tmp/batchjob-cpu-peers-{os.getpid()}-{quantization}.json")
    cmd = [sys.executable, "-m", "batchjob.bench.cpu_peers", "--worker", quantization, "--threads", str(threads),
           "--json", str(with_json)]
    out, process_s, peak_kib = run_measured(cmd, timeout)
    if out.returncode != 0:
        raise RuntimeError(f"batchjob worker exit {out.returncode}: {out.stderr.strip().splitlines()[-3:]}")
    r = json.loads(with_json.read_text())
    with_json.unlink()
    r["process_s"] = process_s
    r["peak_rss_mib"] = peak_kib / 1024 if peak_kib else None
    return r


def worker(quantization: str, threads: int) -> dict:
    import torch

    from batchjob.device import choose_dtype
    from batchjob.engine.core.scheduler import SchedulerConfig
    from batchjob.engine.engine import Engine, EngineConfig
    from batchjob.models.loader import load_model
    from batchjob.models.registry import build_model

    if threads:
        torch.set_num_threads(threads)
    dtype = choose_dtype(None, "cpu")
    t0 = time.perf_counter()
    loaded = load_model("smollm2", dtype=dtype)
    model = build_model(loaded.config, loaded.weights, dtype, kernels="auto", quantization=quantization)
    load_s = time.perf_counter() - t0
    engine = Engine(model, loaded.tokenizer.eos_token_ids, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=ROWS)))
    run = drive_engine(engine, ROWS, PROMPT, GEN)
    return {"system": "batchjob" + ("" if quantization == "none" else f" --quantization {quantization}"),
            "dtype": str(dtype).removeprefix("torch."), "kernels": model.kernels.label, "load_s": load_s, "job_s": run["job_s"],
            "prefill_tok_s_mixed": run["prefill_tok_s_mixed"], "decode_step_ms_64": run["decode_step_ms"],
            "threads": torch.get_num_threads()}


def drive_engine(engine, rows: int, prompt: int, gen: int, seed: int = 31) -> dict:
    """`rows` sequences of `prompt` random token ids (100..32000, seeded) + `gen` generated, EOS ignored, through
    the engine until done: the job's seconds, prefill tokens/s over the steps that prefill (mixed with decodes),
    and the decode steps that run all `rows` rows (their mean ms and tokens/s)."""
    import numpy as np

    from batchjob.engine.params import SamplingParams
    from batchjob.engine.core.sequence import Sequence
    from batchjob.engine.sample.row_keys import row_key

    rng = np.random.default_rng(seed)
    seqs = [Sequence(i, rng.integers(100, 32000, size=prompt).tolist(), SamplingParams(max_tokens=gen, ignore_eos=True),
                     rng_key=row_key(0, i)) for i in range(rows)]
    prefill_tokens = prefill_s = decode_s = 0.0
    decode_steps = 0
    t0 = time.perf_counter()
    for s in seqs:
        engine.add(s)
    while engine.has_work:
        engine.step()
        st = engine.last_stats
        if st is None:
            continue
        if st.num_decode == st.num_seqs:
            decode_steps += st.num_seqs == rows
            decode_s += st.step_s if st.num_seqs == rows else 0.0
        else:
            prefill_tokens += st.num_tokens - st.num_decode
            prefill_s += st.step_s
    job_s = time.perf_counter() - t0
    assert all(s.num_output == gen for s in seqs)
    return {"job_s": job_s, "prefill_tok_s_mixed": prefill_tokens / prefill_s if prefill_s else None,
            "decode_step_ms": 1e3 * decode_s / decode_steps if decode_steps else None,
            "decode_tok_s": rows * decode_steps / decode_s if decode_s else None, "decode_steps": decode_steps}


def ceilings(threads: int) -> dict:
    """This machine's weight-matmul rate on SmolLM2's shapes (oneDNN-packed, as the engine runs them: fp32, and bf16
    where the default dtype is bf16; the native int8 kernel) at 64 and 512 rows, and its read bandwidth (a 1 GiB
    sum)."""
    import torch

    from batchjob.bench import roofline
    from batchjob.bench.models import ModelSpec
    from batchjob.device import choose_dtype, dtype_name

    if threads:
        torch.set_num_threads(threads)
    spec = ModelSpec("smollm2", "", 576, 1536, 30, 576, 192, 49152)
    default = choose_dtype(None, "cpu")
    out = {"matmul_params": spec.matmul_params, "matmul_params_no_head": spec.matmul_params_no_head,
           "default_dtype": dtype_name(default)}
    for dtype in sorted({torch.float32, default}, key=str):
        for rows in (64, 512):
            s = roofline.time_matmuls(spec, rows, dtype, min_s=0.5, reps=2)
            out[f"{dtype_name(dtype)}_gflops_{rows}"] = 2 * spec.matmul_params * rows / s / 1e9
    try:
        from batchjob.kernels import Int8Linear

        g = torch.Generator().manual_seed(0)
        layers = [(i, Int8Linear(torch.randn(o, i, generator=g))) for i, o in spec.matmul_shapes()]
        for rows in (64, 512):
            s = roofline.time_matmuls(spec, rows, torch.float32, min_s=0.5, reps=2, weights=layers)
            out[f"int8_gops_{rows}"] = 2 * spec.matmul_params * rows / s / 1e9
    except Exception as e:  # noqa: BLE001 - a bench column, not the run
        out["int8_error"] = f"{type(e).__name__}: {e}"
    x = torch.ones(1 << 28)  # 1 GiB of fp32
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    out["read_gb_s"] = x.numel() * 4 / best / 1e9
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_flags() -> dict:
    from batchjob.kernels import cpu_identity, cpu_isa

    model, flags = cpu_identity()
    isa_flags = sorted(f for f in flags if re.fullmatch(r"avx512\w*|avx2|fma|f16c|avx_vnni|amx\w*|asimd\w*|sve\w*", f))
    try:
        isa = cpu_isa()
    except Exception as e:  # noqa: BLE001
        isa = f"none ({e})"
    return {"cpu": model, "flags": isa_flags, "native_path": isa}


def shares(r: dict, c: dict) -> dict:
    """The share of the matmul rate and the read bandwidth that prefill and a 64-row decode step reach."""
    out = {}
    if r.get("prefill_tok_s_mixed"):
        flops = 2 * c["matmul_params_no_head"] * r["prefill_tok_s_mixed"]
        out["prefill_gflops"] = flops / 1e9
        out["prefill_share_of_gemm"] = flops / 1e9 / c[f"{r['dtype']}_gflops_512"] if "int8" not in r["system"] else \
            flops / 1e9 / c.get("int8_gops_512", float("nan"))
    if r.get("decode_step_ms_64"):
        step = r["decode_step_ms_64"] / 1e3
        flops = 2 * c["matmul_params"] * ROWS
        out["decode_gflops"] = flops / step / 1e9
        key = "int8_gops_64" if "int8" in r["system"] else f"{r['dtype']}_gflops_64"
        out["decode_share_of_gemm"] = flops / step / 1e9 / c.get(key, float("nan"))
        weight_bytes = c["matmul_params"] * (1 if "int8" in r["system"] else {"float32": 4, "bfloat16": 2}[r["dtype"]])
        ctx = PROMPT + GEN // 2  # the mean context of the decode steps
        kv_bytes = ROWS * ctx * 30 * 2 * 192 * {"float32": 4, "bfloat16": 2}[r["dtype"]]
        out["decode_gb_s"] = (weight_bytes + kv_bytes) / step / 1e9
        out["decode_share_of_bandwidth"] = out["decode_gb_s"] / c["read_gb_s"]
    return out


def measure(threads: int, timeout: float, log=print) -> dict:
    from batchjob.models.loader import resolve_model_path

    threads = threads or len(os.sched_getaffinity(0))
    report = {"machine": cpu_flags(), "workload": f"{ROWS} rows x ({PROMPT} prompt + {GEN} generated) token ids, EOS ignored",
              "loadavg_start": os.getloadavg()}
    log(f"  CPU: {report['machine']['cpu']}; flags {' '.join(report['machine']['flags'])}; native path "
        f"{report['machine']['native_path']}")
    report["ceilings"] = ceilings(threads)
    runs = []
    for q in ("none", "int8"):
        try:
            runs.append(run_batchjob(q, threads, timeout))
        except Exception as e:  # noqa: BLE001
            runs.append({"system": f"batchjob ({q})", "error": str(e)})
        log("  " + line(runs[-1]))
    binary = llama_cpp_binary()
    if binary is None:
        runs.append({"system": "llama.cpp", "error": "not built: run `make bench-llama-cpp` (about 10 minutes)"})
    else:
        try:
            runs.append(run_llama_cpp(binary, str(resolve_model_path("smollm2")), threads, timeout))
        except Exception as e:  # noqa: BLE001
            runs.append({"system": "llama.cpp", "error": str(e)})
    log("  " + line(runs[-1]))
    peer = runs[-1].get("job_s")
    for r in runs:
        if "job_s" in r and "batchjob" in r["system"]:
            r.update(shares(r, report["ceilings"]))
            if peer:
                r["vs_llama_cpp_job"] = peer / r["job_s"]
                r["vs_llama_cpp_process"] = runs[-1]["process_s"] / r["process_s"]
    report["runs"] = runs
    report["loadavg_end"] = os.getloadavg()
    return report


def line_head(r: dict) -> str:
    """A run's system, job and process seconds and peak RSS (this bench's line and bench/scale.py's start so)."""
    s = f"{r['system']}: job {r['job_s']:.1f} s, whole process {r['process_s']:.1f} s"
    if r.get("peak_rss_mib"):
        s += f", peak RSS {r['peak_rss_mib'] / 1024:.2f} GiB"
    return s


def line(r: dict) -> str:
    if "error" in r:
        return f"{r['system']}: {r['error']}"
    s = line_head(r)
    if "kernels" in r:
        s += f" ({r['dtype']}, {r['kernels']} kernels)"
    if "prefill_tok_s" in r:
        s += f"; prefill {r['prefill_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.0f} tok/s"
    return s


def text(report: dict) -> str:
    c, m = report["ceilings"], report["machine"]
    lines = [f"{m['cpu']} ({' '.join(m['flags'])}; native path {m['native_path']}); {report['workload']}",
             f"ceilings: fp32 matmuls {c['float32_gflops_64']:.0f} / {c['float32_gflops_512']:.0f} GFLOP/s at 64 / 512 rows; "
             + (f"bf16 {c['bfloat16_gflops_64']:.0f} / {c['bfloat16_gflops_512']:.0f}; " if "bfloat16_gflops_64" in c else "")
             + (f"int8 {c['int8_gops_64']:.0f} / {c['int8_gops_512']:.0f} GOP/s; " if "int8_gops_64" in c else "")
             + f"read {c['read_gb_s']:.1f} GB/s"]
    for r in report["runs"]:
        s = line(r)
        if "vs_llama_cpp_job" in r:
            s += f"; {r['vs_llama_cpp_job']:.2f}x llama.cpp (job), {r['vs_llama_cpp_process']:.2f}x (whole process)"
        if "decode_share_of_gemm" in r:
            s += (f"; prefill {r.get('prefill_gflops', 0):.0f} GFLOP/s ({r.get('prefill_share_of_gemm', 0):.0%} of the "
                  f"matmul rate), 64-row decode step {r['decode_step_ms_64']:.0f} ms = {r['decode_gflops']:.0f} GFLOP/s "
                  f"({r['decode_share_of_gemm']:.0%}), {r['decode_gb_s']:.1f} GB/s ({r['decode_share_of_bandwidth']:.0%} "
                  f"of the read bandwidth)")
        lines.append("  " + s)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchjob.bench.cpu_peers", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="threads for every system (default: the CPUs this process may use)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", type=Path, help="write the report here (default: print it)")
    ap.add_argument("--worker", choices=["none", "int8"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.json.write_text(json.dumps(worker(args.worker, args.threads)))
        return 0
    report = measure(args.threads, args.timeout, log=lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(text(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
