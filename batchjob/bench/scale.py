"""Scale rows of `make bench` (issue 46): batchjob vs llama.cpp's `llama-batched-bench` on random models with real
shapes (bench/scale_models.py: Llama-3.2-1B's, Qwen3-4B's, Llama-3.1-8B's; SmolLM2's tokenizer), on the same GGUF
file made by llama.cpp's own converter and quantizer (Q4_K_M, Q4_0, Q8_0), the same work: N rows x (128 prompt + 64
generated) token ids, EOS ignored, the machine's thread count.

One row per (model, format). Each side runs as its own process, one after another: batchjob's worker loads the GGUF
with the product's defaults (`batchjob.LLM(path)`, as `batchjob run --model FILE` does: whatever the release does
with the file's quantized weights, this measures) and runs the rows on its engine; `--quantization none` (or int8)
adds a column with that option. For each: the job's seconds (batchjob: the engine from the first row added to the
last token; llama.cpp: its T column), the whole process's seconds and peak RSS (`/usr/bin/time -f %M`), and the
single-row decode tokens/s (one row of 128 + 64 in a process of its own; llama.cpp `-npl 1`).

    python -m batchjob.bench.scale [--models 1b,4b] [--formats Q4_K_M,Q4_0,Q8_0] [--rows 32]
                                   [--quantization default,none] [--quick] [--json FILE]

`--quick`: the tiny model (2 layers, hidden 256), 4 rows x (32 + 16), every step of the pipeline in a minute or
two. `make bench` runs the 1b and 4b rows (`--scale-models 1b,4b,8b` adds the 8B, built only when the disk and the
memory allow it; `--no-scale` skips them)."""
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

from batchjob.bench import cpu_peers, scale_models
from batchjob.bench.report import write_json

ROWS, PROMPT, GEN = 32, 128, 64
QUICK_WORK = (4, 32, 16)
DEFAULT_MODELS = "1b,4b"
# issue 46's acceptance, on the 1B-class Q4_K_M (and Q8_0, Q4_0): job time vs llama.cpp's, peak RSS vs llama.cpp's
TARGET_SPEED = {"avx512": 2.0, "avx2": 1.5}
TARGET_MEMORY = 1.25


def run_batchjob(gguf: Path, rows: int, prompt: int, gen: int, threads: int, quantization: str, timeout: float,
                 dtype: str = "") -> dict:
    """One worker process (`--worker`): batchjob.LLM(gguf) with the product's defaults (plus `--quantization` when
    not "default"), then the rows on its engine."""
    out_json = Path(f"/tmp/batchjob-scale-{os.getpid()}-{rows}-{quantization}.json")
    cmd = [sys.executable, "-m", "batchjob.bench.scale", "--worker", str(gguf), "--rows", str(rows), "--prompt",
           str(prompt), "--gen", str(gen), "--threads", str(threads), "--quantization", quantization, "--json", str(out_json),
           *(["--dtype", dtype] if dtype else [])]
    try:
        out, process_s, peak_kib = cpu_peers.run_measured(cmd, timeout)
        if out.returncode != 0:
            tail = [ln for ln in out.stderr.strip().splitlines() if ln.strip()][-3:]
            raise RuntimeError(f"batchjob worker exit {out.returncode}: " + " | ".join(tail)[-600:])
        r = json.loads(out_json.read_text())
    finally:
        out_json.unlink(missing_ok=True)
    r["process_s"] = process_s
    r["peak_rss_mib"] = peak_kib / 1024 if peak_kib else None
    return r


def worker(gguf: str, rows: int, prompt: int, gen: int, threads: int, quantization: str, dtype: str = "") -> dict:
    import resource

    import torch

    from batchjob.api import LLM

    options = {"max_num_seqs": rows}
    if threads:
        options["threads"] = threads
    if quantization != "default":
        options["quantization"] = quantization
    if dtype:
        options["dtype"] = dtype
    t0 = time.perf_counter()
    llm = LLM(gguf, **options)
    load_s = time.perf_counter() - t0
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run = cpu_peers.drive_engine(llm.engine, rows, prompt, gen)
    try:
        resolved = llm.resolved.quantization(llm.loaded)
    except Exception as e:  # noqa: BLE001 - a label, not the run
        resolved = f"? ({type(e).__name__})"
    try:  # the weights' bytes in memory per format (Q4_K, Q6_K, bfloat16, ...), as the start line says them
        weights = {k: v / 2**20 for k, v in sorted(llm.engine.model.weight_memory().items(), key=lambda kv: -kv[1])}
    except Exception:  # noqa: BLE001 - a column, not the run
        weights = None
    return {"system": "batchjob" + ("" if quantization == "default" else f" --quantization {quantization}"),
            "dtype": llm.resolved.dtype_name, "kernels": llm.kernels, "quantization": str(resolved),
            "weights_mib": weights, "threads": torch.get_num_threads(), "load_s": load_s,
            "load_peak_rss_mib": load_peak / 1024, **run}


def wait_quiet(max_load: float, log, limit_s: float = 600) -> None:
    """Waits (up to limit_s) until the 1-minute load average is below max_load: another heavy process on the
    machine would skew the next run. 0: no waiting."""
    if not max_load:
        return
    t0 = time.monotonic()
    said = False
    while os.getloadavg()[0] >= max_load and time.monotonic() - t0 < limit_s:
        if not said:
            log(f"    (load average {os.getloadavg()[0]:.2f} >= {max_load}: waiting for a quiet machine)")
            said = True
        time.sleep(5)


def _side(fn, *args) -> dict:
    try:
        return fn(*args)
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {e.timeout:.0f} s"}
    except Exception as e:  # noqa: BLE001 - one failed side is a row's cell, not the bench
        return {"error": f"{type(e).__name__}: {e}"}


def measure(models: list[str], formats: tuple[str, ...] = scale_models.FORMATS, rows: int = ROWS, prompt: int = PROMPT,
            gen: int = GEN, threads: int = 0, quantizations: tuple[str, ...] = ("default",), single: bool = True,
            cache: Path = scale_models.CACHE, timeout: float = 3600, max_load: float = 0.0, force: bool = False,
            log=print, dtype: str = "") -> dict:
    threads = threads or len(os.sched_getaffinity(0))
    machine = cpu_peers.cpu_flags()
    report = {"machine": machine, "workload": f"{rows} rows x ({prompt} prompt + {gen} generated) token ids, EOS ignored",
              "n_rows": rows, "prompt": prompt, "gen": gen, "threads": threads, "loadavg_start": os.getloadavg(),
              "code": _code(), "models": {}, "skipped": {}, "rows": [], "dtype": dtype or "default",
              "forced": {v: os.environ[v] for v in ("BATCHJOB_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                     "MKL_ENABLE_INSTRUCTIONS", "LLAMA_BATCHED_BENCH") if v in os.environ}}
    binary = cpu_peers.llama_cpp_binary()
    why = scale_models.missing_tools() or (None if binary else "llama-batched-bench is not built: run `make bench-llama-cpp`")
    if why:
        report["skipped"]["all"] = why
        log(f"  scale rows skipped: {why}")
        return report
    for name in models:
        if name not in scale_models.SHAPES:
            report["skipped"][name] = f"unknown model; known: {', '.join(scale_models.SHAPES)}"
            log(f"  {name}: skipped: {report['skipped'][name]}")
            continue
        shape = scale_models.SHAPES[name]
        skip = None if force else scale_models.room(shape, formats, cache)
        if skip:
            report["skipped"][name] = skip
            log(f"  {name} ({shape.like}): skipped: {skip}")
            continue
        built = _build(name, formats, cache, threads, timeout, log)
        if isinstance(built, str):
            report["skipped"][name] = built
            log(f"  {name}: build failed: {built}")
            continue
        report["models"][name] = built
        for fmt in formats:
            gguf = Path(built["ggufs"][fmt]["path"])
            row = {"model": name, "like": shape.like, "params": shape.params, "format": fmt, "gguf": str(gguf),
                   "gguf_bytes": gguf.stat().st_size, "loadavg": os.getloadavg(), "systems": []}
            log(f"  {name} {fmt} ({gguf.stat().st_size / 1e9:.2f} GB): {rows} x ({prompt} + {gen}) ...")
            for q in quantizations:
                wait_quiet(max_load, log)
                r = _side(run_batchjob, gguf, rows, prompt, gen, threads, q, timeout, dtype)
                r.setdefault("system", "batchjob" + ("" if q == "default" else f" --quantization {q}"))
                if single and "error" not in r:
                    wait_quiet(max_load, log)
                    one = _side(run_batchjob, gguf, 1, prompt, gen, threads, q, timeout, dtype)
                    r["single_row"] = _single(one)
                row["systems"].append(r)
                log("    " + line(r))
            wait_quiet(max_load, log)
            r = _side(cpu_peers.run_llama_cpp, binary, str(gguf), threads, timeout, rows, prompt, gen)
            r.setdefault("system", "llama.cpp")
            if single and "error" not in r:
                wait_quiet(max_load, log)
                r["single_row"] = _single(_side(cpu_peers.run_llama_cpp, binary, str(gguf), threads, timeout, 1, prompt, gen))
            row["systems"].append(r)
            log("    " + line(r))
            _compare(row, machine)
            report["rows"].append(row)
            for t in row.get("targets", []):
                log(f"    target {t['what']}: {t['value']:.2f}x (goal {t['goal']}) {'met' if t['met'] else 'NOT met'}")
    report["loadavg_end"] = os.getloadavg()
    return report


def _code() -> dict | None:
    """The commit the numbers ran on, and whether the working tree had changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return {"commit": head.stdout.strip(), "uncommitted_changes": bool(dirty.stdout.strip())}


def _build(name: str, formats: tuple[str, ...], cache: Path, threads: int, timeout: float, log) -> dict | str:
    """The model's files, built by bench/scale_models.py in its own process (its peak RSS recorded): a summary, or
    why it failed."""
    shape = scale_models.SHAPES[name]
    _, hf, files = scale_models.paths(shape, cache)
    cached = hf.joinpath("model.safetensors.index.json").is_file() and all(files[f].is_file() for f in formats)
    built_s = peak = None
    if not cached:
        log(f"  {name}: building {shape.like}'s shapes ({shape.params / 1e9:.2f} B params) as bf16 safetensors and "
            f"{', '.join(formats)} GGUFs in {cache / name} ...")
        cmd = [sys.executable, "-m", "batchjob.bench.scale_models", "--models", name, "--formats", ",".join(formats),
               "--cache-dir", str(cache), "--threads", str(threads)]
        try:
            out, built_s, peak = cpu_peers.run_measured(cmd, timeout)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f} s"
        if out.returncode != 0:
            tail = [ln for ln in (out.stderr + out.stdout).strip().splitlines() if ln.strip()][-3:]
            return f"exit {out.returncode}: " + " | ".join(tail)[-600:]
        for ln in out.stdout.splitlines():
            if ln.startswith("  built:"):
                log(f"  {name}:{ln.strip().removeprefix('built:')} (peak RSS {peak / 2**20:.2f} GiB)" if peak else ln)
    missing = [f for f in formats if not files[f].is_file()]
    if missing:
        return f"not built: {', '.join(missing)}"
    return {"like": shape.like, "params": shape.params, "hf": str(hf), "cached": cached, "build_s": built_s,
            "build_peak_rss_mib": peak / 1024 if peak else None,
            "ggufs": {f: {"path": str(p), "bytes": p.stat().st_size} for f, p in files.items() if p.is_file()}}


def _single(r: dict) -> dict:
    if "error" in r:
        return {"error": r["error"]}
    return {"decode_tok_s": r.get("decode_tok_s"), "job_s": r.get("job_s"), "process_s": r.get("process_s"),
            "peak_rss_mib": r.get("peak_rss_mib")}


def _compare(row: dict, machine: dict) -> None:
    """Each batchjob column against llama.cpp: its speed (llama.cpp's job time / ours), its memory (our peak RSS /
    llama.cpp's) and its single-row decode rate (ours / llama.cpp's); the issue's targets on the 1B."""
    peer = next((s for s in row["systems"] if s["system"] == "llama.cpp"), {})
    for s in row["systems"]:
        if s is peer or "error" in s or "error" in peer:
            continue
        s["speedup_job"] = peer["job_s"] / s["job_s"]
        s["speedup_process"] = peer["process_s"] / s["process_s"]
        if s.get("peak_rss_mib") and peer.get("peak_rss_mib"):
            s["memory_ratio"] = s["peak_rss_mib"] / peer["peak_rss_mib"]
        a, b = (s.get("single_row") or {}).get("decode_tok_s"), (peer.get("single_row") or {}).get("decode_tok_s")
        if a and b:
            s["single_row_decode_ratio"] = a / b
    bj = next((s for s in row["systems"] if s["system"] == "batchjob"), None)
    path = str(machine.get("native_path", ""))
    if row["model"] == "1b" and bj and "speedup_job" in bj and path in TARGET_SPEED:
        row["targets"] = [
            {"what": f"job time vs llama.cpp ({path})", "value": bj["speedup_job"], "goal": TARGET_SPEED[path],
             "met": bj["speedup_job"] >= TARGET_SPEED[path]},
        ]
        if "memory_ratio" in bj:
            row["targets"].append({"what": "peak RSS / llama.cpp's (at most)", "value": bj["memory_ratio"],
                                   "goal": TARGET_MEMORY, "met": bj["memory_ratio"] <= TARGET_MEMORY})


def line(r: dict) -> str:
    if "error" in r:
        return f"{r['system']}: {r['error']}"
    s = cpu_peers.line_head(r)
    if "kernels" in r:
        s += f" ({r['dtype']}, {r['kernels']} kernels, --quantization resolved to {r.get('quantization')}, load {r['load_s']:.1f} s)"
    if r.get("weights_mib"):
        w = r["weights_mib"]
        s += f"; weights {sum(w.values()):.0f} MiB (" + ", ".join(f"{k} {v:.0f}" for k, v in w.items()) + ")"
    one = r.get("single_row") or {}
    if one.get("decode_tok_s"):
        s += f"; one row decodes {one['decode_tok_s']:.1f} tok/s"
    elif one.get("error"):
        s += f"; one row: {one['error']}"
    return s


def text(report: dict) -> str:
    m = report["machine"]
    lines = [f"{m['cpu']} (native path {m['native_path']}); {report['workload']}, {report['threads']} threads"]
    for name, why in report.get("skipped", {}).items():
        lines.append(f"  {name}: skipped: {why}")
    head = (f"  {'model':5} {'format':7} {'system':30} {'job s':>7} {'process s':>9} {'peak RSS':>9} {'1-row tok/s':>11}"
            f" {'vs llama.cpp: time':>18} {'memory':>7} {'1-row':>6}")
    if report.get("rows"):
        lines.append(head)
    for row in report.get("rows", []):
        for s in row["systems"]:
            label = s["system"]
            if "error" in s:
                lines.append(f"  {row['model']:5} {row['format']:7} {label:30} {s['error']}")
                continue
            one = (s.get("single_row") or {}).get("decode_tok_s")
            vs = (f" {s['speedup_job']:>17.2f}x {_x(s.get('memory_ratio')):>7} {_x(s.get('single_row_decode_ratio')):>6}"
                  if "speedup_job" in s else "")
            lines.append(f"  {row['model']:5} {row['format']:7} {label:30} {s['job_s']:>7.1f} {s['process_s']:>9.1f} "
                         f"{(s.get('peak_rss_mib') or 0) / 1024:>7.2f} G {f'{one:.1f}' if one else '-':>11}{vs}")
        for t in row.get("targets", []):
            lines.append(f"        target: {t['what']} {t['value']:.2f}x, goal {t['goal']}: {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchjob.bench.scale", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated: 1b,4b,8b (default: {DEFAULT_MODELS})")
    ap.add_argument("--formats", default=",".join(scale_models.FORMATS),
                    help=f"comma-separated GGUF types (default: {','.join(scale_models.FORMATS)})")
    ap.add_argument("--rows", type=int, default=0, help=f"rows per job (default: {ROWS}; --quick: {QUICK_WORK[0]})")
    ap.add_argument("--prompt", type=int, default=0, help=f"prompt tokens per row (default: {PROMPT})")
    ap.add_argument("--gen", type=int, default=0, help=f"generated tokens per row (default: {GEN})")
    ap.add_argument("--threads", type=int, default=0, help="threads for both sides (default: the CPUs this process may use)")
    ap.add_argument("--quantization", default="default",
                    help="comma-separated batchjob columns: default (the product's defaults for a GGUF), none, int8 "
                         "(default: default)")
    ap.add_argument("--no-single", action="store_true", help="skip the single-row decode runs")
    ap.add_argument("--dtype", default="", help="batchjob's compute dtype (default: the CPU's; float32 for an AVX2 run "
                                                "forced on an AVX-512 machine, as an AVX2 CPU gets)")
    ap.add_argument("--quick", action="store_true", help=f"the tiny model only, {QUICK_WORK[0]} x ({QUICK_WORK[1]} + "
                                                         f"{QUICK_WORK[2]}): the whole pipeline in a minute or two")
    ap.add_argument("--max-load", type=float, default=0.0,
                    help="before each run, wait (up to 10 min) until the 1-minute load average is below this (default: 0, never)")
    ap.add_argument("--force", action="store_true", help="build and run every model named, without the disk and memory check")
    ap.add_argument("--cache-dir", type=Path, default=scale_models.CACHE)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    ap.add_argument("--json", type=Path, help="also write the report here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    # a SIGTERM (`timeout`, a scheduler) unwinds like Ctrl-C: run_measured then kills the child it waits on
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.quick:
        models = ["quick"]
        rows, prompt, gen = (args.rows or QUICK_WORK[0], args.prompt or QUICK_WORK[1], args.gen or QUICK_WORK[2])
    else:
        models = [m for m in args.models.split(",") if m]
        rows, prompt, gen = args.rows or ROWS, args.prompt or PROMPT, args.gen or GEN
    if args.worker:
        args.json.write_text(json.dumps(worker(args.worker, rows, prompt, gen, args.threads, args.quantization, args.dtype)))
        return 0
    unknown = [m for m in models if m not in scale_models.SHAPES]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; known: {', '.join(scale_models.SHAPES)}")
    formats = tuple(f for f in args.formats.split(",") if f)
    bad = [f for f in formats if not re.fullmatch(r"[A-Z0-9_]+", f)]
    if bad:
        raise SystemExit(f"bad formats {bad}: llama-quantize type names such as Q4_K_M")
    report = measure(models, formats, rows, prompt, gen, args.threads,
                     tuple(q for q in args.quantization.split(",") if q), not args.no_single, args.cache_dir,
                     args.timeout, args.max_load, args.force, log=lambda m: print(m, file=sys.stderr, flush=True),
                     dtype=args.dtype)
    if args.json:
        write_json(args.json, report)
    print(text(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
