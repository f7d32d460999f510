"""`make bench`'s int8 section (issue 25): W1 on SmolLM2 with bf16 and with `--quantization int8` matmuls in
one run, each a fresh bench worker process (`batchjob` and `batchjob-int8`, bench/systems.py), taking turns
for `rounds` rounds, the best of each quoted:

- tokens/s: output tokens / generation seconds, and whole-process (start, imports, load, warm-up and
  generation); the target: int8 >= 1.5x bf16 whole-process;
- the GEMM rates of both on SmolLM2's shapes as a share of the raw `_int_mm` / bf16 `F.linear` rates
  (bench/int8_matmul.py) and the quality table (bench/int8_quality.py), each in its own process.

    python -m batchjob.bench.int8_speed [--rounds 2] [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from batchjob.bench.paths import CACHE

TARGET = 1.5
SYSTEMS = ("batchjob", "batchjob-int8")


def jobs(spec, rounds: int = 2, rows: int = 0, timeout: float = 3600, threads: int = 0, log=print) -> list[dict]:
    """The best W1 row of each system over `rounds` alternating worker processes."""
    from batchjob.bench import launch, report

    best: dict[str, dict] = {}
    for rnd in range(rounds):
        for system in SYSTEMS:
            results, err = launch.run_system(system, spec, ["W1"], rows=rows, timeout=timeout, threads=threads)
            if not results:
                log(f"  W1 {system} (round {rnd + 1}): failed: {err}")
                continue
            row = report.summarize(results[0])
            log(f"  W1 {system} (round {rnd + 1}): {row['tok_s']:.0f} tok/s generating, {row['process_tok_s']:.0f} "
                f"whole process ({row['process_s']:.1f} s), peak RSS {row['peak_rss_mb']:.0f} MB")
            if system not in best or row["process_tok_s"] > best[system]["process_tok_s"]:
                best[system] = row
    keep = ("system", "kernels", "dtype", "threads", "rows", "output_tokens", "tokens_ok", "gen_s", "tok_s", "process_s",
            "process_tok_s", "peak_rss_mb")
    return [{k: best[s].get(k) for k in keep} for s in SYSTEMS if s in best]


def gemm_shares(kernels: list[dict]) -> list[dict]:
    """Per shape and rows: each path's rate as a share of the raw GEMM of its kind (bf16 Linear / F.linear bf16,
    int8 Linear / _int_mm, and / the better of _int_mm and qlinear)."""
    out = []
    for r in kernels:
        g = r["gops"]
        raw_int8 = max(g.get("_int_mm", 0), g.get("qlinear", 0))
        out.append({"shape": r["shape"], "rows": r["rows"], "bf16_gflops": g["bf16"], "int8_gops": g["int8"],
                    "bf16_share_of_f_linear": round(g["bf16"] / g["F.linear bf16"], 3),
                    "int8_share_of_int_mm": round(g["int8"] / g["_int_mm"], 3),
                    "int8_share_of_raw_int8": round(g["int8"] / raw_int8, 3), "int8_speedup": round(g["int8"] / g["bf16"], 3)})
    return out


def measure(cache_dir: Path, rounds: int = 2, quick: bool = False, timeout: float = 3600, threads: int = 0,
            log=print) -> dict:
    from batchjob.bench import int8_matmul, int8_quality, launch, models

    spec = models.prepare("smollm2", cache_dir)
    rows = jobs(spec, rounds, rows=16 if quick else 0, timeout=timeout, threads=threads, log=log)
    result = {"workload": "W1" + (" (first 16 rows)" if quick else ""), "jobs": rows, "target": TARGET}
    by = {r["system"]: r for r in rows}
    if len(by) == 2:
        result["speedup_process"] = round(by["batchjob-int8"]["process_tok_s"] / by["batchjob"]["process_tok_s"], 3)
        result["speedup_generation"] = round(by["batchjob-int8"]["tok_s"] / by["batchjob"]["tok_s"], 3)
        result["target_met"] = result["speedup_process"] >= TARGET
        log(f"  int8 / bf16: x{result['speedup_process']:.2f} whole process, x{result['speedup_generation']:.2f} generating "
            f"(target x{TARGET}: {'met' if result['target_met'] else 'NOT met'})")
    kern, err = launch.run_json_module("batchjob.bench.int8_matmul", ["--reps", "5"] if quick else [], timeout)
    if err is None:
        result["kernels"], result["gemm_shares"] = kern, gemm_shares(kern)
        log(int8_matmul.text(kern))
    else:
        log(f"  int8 kernel table failed: {err}")
    qual, err = launch.run_json_module("batchjob.bench.int8_quality",
                                       ["--prompts", "8", "--max-tokens", "16"] if quick else ["--prompts", "32"], timeout)
    if err is None:
        result["quality"] = qual
        log(int8_quality.text(qual))
    else:
        log(f"  int8 quality table failed: {err}")
    return result


def text(r: dict) -> str:
    lines = [f"  W1 {j['system']:14} {j['tok_s']:.0f} tok/s generating, {j['process_tok_s']:.0f} whole process"
             for j in r["jobs"]]
    if "speedup_process" in r:
        lines.append(f"  int8 / bf16: x{r['speedup_process']:.2f} whole process, x{r['speedup_generation']:.2f} generating "
                     f"(target x{r['target']}: {'met' if r['target_met'] else 'NOT met'})")
    for s in r.get("gemm_shares", []):
        lines.append(f"  {s['shape']:7} {s['rows']:3} rows: bf16 {s['bf16_gflops']:.0f} GFLOP/s "
                     f"({s['bf16_share_of_f_linear']:.0%} of F.linear), int8 {s['int8_gops']:.0f} GOP/s "
                     f"({s['int8_share_of_int_mm']:.0%} of _int_mm), x{s['int8_speedup']:.2f}")
    if "quality" in r:
        from batchjob.bench.int8_quality import text as quality_text

        lines.append(quality_text(r["quality"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchjob.bench.int8_speed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="16 rows of W1, fewer repetitions and prompts")
    ap.add_argument("--cache-dir", type=Path, default=CACHE)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the report here (default: print it)")
    args = ap.parse_args(argv)
    report = measure(args.cache_dir, args.rounds, args.quick, threads=args.threads)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    else:
        print(text(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
