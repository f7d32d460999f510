"""`batchjob bench` / `python -m batchjob.bench`: the issue-7 benchmark in one invocation.

Order: build the models (cached in the bench cache: bench/paths.py), time the matmul ceiling, run every system on every
workload (one process per system and model), run the pipeline jobs, then print the table and targets and
write results-<date>.json and .png (bench/ in a checkout)."""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from batchjob.bench import cpu_peers, images, kv_speed, lora, moe, prefill, report, scale_models, speculative, structured
from batchjob.bench.paths import CACHE, REPORTS
from batchjob.bench.systems import OPTIONAL_SYSTEMS, SYSTEMS

MODELS = ["tiny", "smollm2"]
# Peers that need minutes per workload on SmolLM2 run its headline workload (W1) only, unless --full.
SLOW_ON_SMOLLM2 = {"hf-static16", "hf-static64", "hf-continuous", "vllm", "batchjob-static64", "batchjob-torch"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="batchjob bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny model, first 16 rows of each workload, pipeline at 1k/10k rows")
    ap.add_argument("--workloads", default="W1,W2,W3", help="comma-separated: W1,W2,W3")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated: {','.join(SYSTEMS)} (optional: {','.join(OPTIONAL_SYSTEMS)})")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: tiny,smollm2")
    ap.add_argument("--rows", type=int, default=0, help="first N rows of each workload (default: all)")
    ap.add_argument("--full", action="store_true",
                    help="every system on every model and workload (default: on smollm2 the HF peers, vLLM and "
                         "batchjob static 64 run W1 only)")
    ap.add_argument("--pipeline-rows", default="10000,100000,1000000", help="comma-separated row counts for the pipeline jobs")
    ap.add_argument("--resume-parts", default="100,100000", help="comma-separated committed part counts to resume after")
    ap.add_argument("--pipeline-format", default="jsonl", choices=["jsonl", "parquet"])
    ap.add_argument("--no-pipeline", action="store_true")
    ap.add_argument("--pipeline-only", action="store_true")
    ap.add_argument("--no-roofline", action="store_true")
    ap.add_argument("--speculative-batches", default="1,4,16,64",
                    help="batch sizes of the speculative workload (SmolLM2 rewriting texts); empty: skip it")
    ap.add_argument("--no-kv-speed", action="store_true", help="skip the quantized-KV speed runs (bench/kv_speed.py)")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill-only rows (bench/prefill.py: 1,000-row "
                    "embed and score jobs vs HF transformers)")
    ap.add_argument("--no-int8", action="store_true", help="skip the int8 compute section (bench/int8_speed.py: W1 bf16 vs "
                    "--quantization int8, the GEMM table, perplexity and greedy agreement)")
    ap.add_argument("--no-cpu-peers", action="store_true", help="skip batchjob vs llama.cpp on this CPU (bench/cpu_peers.py: "
                    "SmolLM2, 64 x (128 + 128) token ids, default and --quantization int8, the machine's ceilings)")
    ap.add_argument("--no-scale", action="store_true", help="skip the scale rows (bench/scale.py: random 1B/4B/8B-shaped models as "
                    "GGUF Q4_K_M, Q4_0, Q8_0, batchjob vs llama.cpp's llama-batched-bench on the same file)")
    ap.add_argument("--scale-models", default="1b,4b", help="comma-separated scale models: 1b,4b,8b (default: 1b,4b; the 8B "
                    "only where the disk and the memory allow it; --quick: a tiny model)")
    ap.add_argument("--scale-rows", type=int, default=0, help="rows of each scale job (default: 32)")
    ap.add_argument("--no-structured", action="store_true", help="skip the structured-outputs row (bench/structured.py)")
    ap.add_argument("--no-moe", action="store_true", help="skip the MoE row (bench/moe.py: a tiny MoE and its dense equivalent)")
    ap.add_argument("--image-rows", type=int, default=256, help="rows of the image row (bench/images.py: one 512 x 384 "
                    "image x 32 tokens each on a SmolVLM-256M-shaped model vs HF static 16; ~4 s a row for batchjob and ~17 for "
                    "HF on a 2-core AVX-512 VM; 0: skip)")
    ap.add_argument("--no-profile", action="store_true", help="skip the decode-step profiles (native and torch kernels)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in every process (default: torch's, all cores)")
    ap.add_argument("--out-dir", default=str(REPORTS), help="folder of results-<date>.json and .png (default: %(default)s)")
    ap.add_argument("--cache-dir", default=str(CACHE), help="built models and pipeline files (default: %(default)s; bench/paths.py)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per bench process")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.rows = "tiny", args.rows or 16
        if args.pipeline_rows == "10000,100000,1000000":
            args.pipeline_rows = "1000,10000"
        if args.resume_parts == "100,100000":
            args.resume_parts = "100,2000"
        if args.speculative_batches == "1,4,16,64":
            args.speculative_batches = "1,4"
    return args


def plan(args) -> list[tuple[str, str, list[str]]]:
    """(model, system, workloads) per bench process."""
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS + OPTIONAL_SYSTEMS]
    if unknown:
        raise SystemExit(f"bench: unknown systems {unknown}; known: {', '.join(SYSTEMS + OPTIONAL_SYSTEMS)}")
    workloads = [w for w in args.workloads.split(",") if w]
    out = []
    for model in [m for m in args.models.split(",") if m]:
        if model not in MODELS:
            raise SystemExit(f"bench: unknown model {model!r}; known: {', '.join(MODELS)}")
        for system in systems:
            wls = workloads
            if model == "smollm2" and not args.full and system.removesuffix("-bf16") in SLOW_ON_SMOLLM2:
                wls = [w for w in workloads if w == "W1"]
            if wls:
                out.append((model, system, wls))
    return out


def machine() -> dict:
    import torch

    from batchjob.device import cpu_has_bf16_matmul

    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu or platform.processor(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "bf16_matmul": cpu_has_bf16_matmul(), "torch": torch.__version__, "python": platform.python_version(),
            "loadavg_start": os.getloadavg(), "isa": cpu_peers.cpu_flags()}  # the instruction sets the numbers ran on
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    out_dir = Path(args.out_dir)
    stamp = time.strftime("%Y-%m-%d-%H%M")
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    import torch

    from batchjob.bench import launch, models, roofline
    from batchjob.bench.workloads import make

    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine()
    log(f"bench: {info['cpu']}, {info['cores']} cores, torch {info['torch']} ({info['torch_threads']} threads), "
        f"load average {info['loadavg_start'][0]:.1f}")
    work = plan(args) if not args.pipeline_only else []
    wanted = list(dict.fromkeys(m for m, _, _ in work))
    specs = {}
    for name in wanted:
        t = time.perf_counter()
        specs[name] = models.prepare(name, Path(args.cache_dir))
        log(f"model {name}: {specs[name].path} ({specs[name].matmul_params / 1e6:.1f} M matmul params/token, "
            f"ready in {time.perf_counter() - t:.1f} s)")

    def ceilings(when: str) -> None:
        for name, spec in specs.items():
            for dtype in (torch.bfloat16, torch.float32):
                t = roofline.measure(spec, dtype, batches=(1, 16, 64, 128, 256))
                key = f"{name}/{t['dtype']}"
                if key in tables:  # the ceiling is the best the machine showed, start or end
                    t["flops_start"] = tables[key]["flops"]
                    t["flops"] = {m: max(v, t["flops_start"][m]) for m, v in t["flops"].items()}
                    t["ceiling_tok_s"] = {m: f / (2 * spec.matmul_params) for m, f in t["flops"].items()}
                    t["flops_hot"] = {m: max(v, tables[key]["flops_hot"][m]) for m, v in t["flops_hot"].items()}
                tables[key] = t
                log(f"matmul ceiling ({when}) {name} {t['dtype']}: " + ", ".join(
                    f"{m} rows {t['flops'][m] / 1e9:.0f} GFLOP/s = {t['ceiling_tok_s'][m]:.0f} tok/s" for m in (16, 64, 256))
                    + f" (weights hot in cache, F.linear: 64 rows {t['flops_hot'][64] / 2 / spec.matmul_params:.0f} tok/s)")

    tables: dict = {}
    if work and not args.no_roofline:
        ceilings("start")

    raws: list[tuple[dict, object]] = []
    failed: list[dict] = []
    for model, system, wls in work:
        spec = specs[model] = models.prepare(model, Path(args.cache_dir))  # rebuilt if the cache was removed meanwhile
        log(f"run {system} on {model}: {','.join(wls)} ...")
        results, err = launch.run_system(system, spec, wls, rows=args.rows, timeout=args.timeout, threads=args.threads)
        done = set()
        for raw in results:
            raws.append((raw, spec))
            row = report.summarize(raw)
            done.add(raw["workload"])
            log(f"  {model} {raw['workload']} {system}: {row['tok_s']:.0f} tok/s ({row['output_tokens']} tokens in "
                f"{row['gen_s']:.1f} s, process {row['process_s']:.1f} s), peak RSS {row['peak_rss_mb']:.0f} MB"
                + ("" if row["tokens_ok"] else f"  TOKEN COUNT MISMATCH (expected {row['useful_tokens']})"))
        for w in wls:
            if w not in done:
                status = err if err and err.startswith("skipped") else f"failed: {err or 'no result'}"
                failed.append(report.failed_row(system, model, w, status))
                log(f"  {model} {w} {system}: {status}")
    if work and not args.no_roofline:
        ceilings("end")

    profiles = []
    if not args.no_profile:
        from batchjob.bench import decode_profile as profile

        for name, spec in specs.items():
            for kernels in ("native", "torch"):
                for warm in (0, 64):  # decode just after the prompts, and 64 tokens on
                    log(f"profile {name}: 64-row decode steps, {kernels} kernels, {warm} tokens after the prompts ...")
                    prof, err = launch.run_profile(spec, kernels, warm, threads=args.threads, timeout=args.timeout)
                    if prof:
                        profiles.append({"model": name, "warm_steps": warm, **prof})
                        log("  " + profile.summary_line(prof))
                    else:
                        log(f"  failed: {err}")
    rows = [report.summarize(raw, spec, tables) for raw, spec in raws] + failed

    pipe = None
    if not args.no_pipeline:
        from batchjob.bench import pipeline

        sizes = tuple(int(n) for n in args.pipeline_rows.split(",") if n)
        tiny = models.prepare("tiny", Path(args.cache_dir))
        log(f"pipeline: batchjob run, max_tokens 1, tiny model, {args.pipeline_format}, {', '.join(f'{n:,}' for n in sizes)} rows")
        pipe = pipeline.measure(Path(args.cache_dir) / "pipeline", str(Path(tiny.path).resolve()), sizes,
                                fmt=args.pipeline_format, log=log)
        from batchjob.bench import resume

        counts = [int(n) for n in args.resume_parts.split(",") if n]
        if counts:
            log(f"resume after {', '.join(f'{n:,}' for n in counts)} committed one-row parts ...")
            import tempfile

            with tempfile.TemporaryDirectory(prefix="batchjob-resume-parts-", dir=args.cache_dir) as tmp:
                pipe["resume_parts"] = resume.measure_parts(counts, str(Path(tiny.path).resolve()), tmp,
                                                            log=lambda m: log("  " + m))

    spec_rows = kv_rows = None
    if args.speculative_batches and not args.pipeline_only:
        log(f"speculative (ngram) on SmolLM2 rewriting texts, batches {args.speculative_batches} ...")
        spec_rows, err = launch.run_json_module("batchjob.bench.speculative", ["--batches", args.speculative_batches],
                                                args.timeout)
        log(speculative.text(spec_rows) if err is None else f"  failed: {err}")
    if not args.no_kv_speed and not args.pipeline_only:
        log("quantized KV cache (native kernels): attention per layer and SmolLM2 jobs, auto / int8 / int4 ...")
        kv_rows, err = launch.run_json_module("batchjob.bench.kv_speed",
                                              ["--rows", "16", "--max-tokens", "16"] if args.quick else [], args.timeout)
        log(kv_speed.text(kv_rows) if err is None else f"  failed: {err}")

    int8_rows = None
    if not args.no_int8 and not args.pipeline_only:
        from batchjob.bench import int8_speed

        log("int8 compute (--quantization int8): W1 on SmolLM2, bf16 and int8 worker processes taking turns ...")
        int8_rows = int8_speed.measure(Path(args.cache_dir), rounds=1 if args.quick else 2, quick=args.quick,
                                       timeout=args.timeout, threads=args.threads, log=log)

    peer_rows = None
    if not args.no_cpu_peers and not args.pipeline_only and not args.quick:
        log("CPU peers: batchjob (default, --quantization int8) vs llama.cpp, SmolLM2 64 x (128 + 128) token ids ...")
        peer_rows, err = launch.run_json_module("batchjob.bench.cpu_peers", ["--threads", str(args.threads)], args.timeout)
        log(cpu_peers.text(peer_rows) if err is None else f"  failed: {err}")

    scale_rows = None
    if not args.no_scale and not args.pipeline_only:
        from batchjob.bench import scale

        names = ["quick"] if args.quick else [m for m in args.scale_models.split(",") if m]
        rows_n, prompt, gen = scale.QUICK_WORK if args.quick else (scale.ROWS, scale.PROMPT, scale.GEN)
        rows_n = args.scale_rows or rows_n
        log(f"scale rows: random {'/'.join(names)} models as GGUF {', '.join(scale_models.FORMATS)}, batchjob vs "
            f"llama-batched-bench, {rows_n} x ({prompt} + {gen}) token ids (models cached in {Path(args.cache_dir) / 'scale'}) ...")
        scale_rows = scale.measure(names, rows=rows_n, prompt=prompt, gen=gen, threads=args.threads,
                                   cache=Path(args.cache_dir) / "scale", timeout=args.timeout, log=log)

    moe_rows = None
    if not args.no_moe and not args.pipeline_only:
        log("MoE: a small Qwen3-MoE and its dense equivalent of the same active parameters, batchjob vs HF ...")
        moe_rows, err = launch.run_json_module("batchjob.bench.moe", ["--rows", "8", "--max-tokens", "8"] if args.quick else [],
                                               args.timeout)
        log(moe.text(moe_rows) if err is None else f"  failed: {err}")

    image_rows = None
    if args.image_rows and not args.pipeline_only:
        n = min(args.image_rows, 4) if args.quick else args.image_rows
        log(f"images: {n} rows x one 512 x 384 image x 32 tokens, SmolVLM-256M shapes, batchjob vs HF static 16 ...")
        image_rows, err = launch.run_json_module("batchjob.bench.images", ["--rows", str(n)], 3 * args.timeout)
        log(images.text(image_rows) if err is None else f"  failed: {err}")

    lora_rows = None
    if not args.pipeline_only and not args.quick:
        log("LoRA: W1 over 8 rank-16 adapters on SmolLM2 vs the base model and 8 separate jobs ...")
        lora_rows, err = launch.run_json_module("batchjob.bench.lora", [], args.timeout)
        log(lora.text(lora_rows) if err is None else f"  failed: {err}")

    structured_rows = None
    if not args.no_structured and not args.pipeline_only:
        log("structured outputs: a 64-row job with every row JSON-schema constrained vs unconstrained ...")
        structured_rows, err = launch.run_json_module("batchjob.bench.structured", ["--rows", "8", "--max-tokens", "8",
                                                      "--steps", "20"] if args.quick else [], args.timeout)
        log(structured.job_text(structured_rows["job"]) if err is None else f"  failed: {err}")

    prefill_rows = None
    if not args.no_prefill and not args.pipeline_only:
        log("prefill-only jobs: 1,000-row embed and score jobs on SmolLM2, batchjob vs HF transformers ...")
        prefill_rows, err = launch.run_json_module("batchjob.bench.prefill", ["--rows", "64", "--repeats", "1"]
                                                   if args.quick else [], args.timeout)
        log(prefill.text(prefill_rows) if err is None else f"  failed: {err}")

    tgts = report.targets(rows, pipe, profiles)
    info["loadavg_end"] = os.getloadavg()
    result = {
        "date": stamp, "args": vars(args), "machine": info, "elapsed_s": time.time() - t_start,
        "workloads": {w: make(w).summary() for w in args.workloads.split(",") if w},
        "models": {n: {"path": s.path, "matmul_params": s.matmul_params} for n, s in specs.items()},
        "roofline": tables, "results": rows, "pipeline": pipe, "profiles": profiles, "targets": tgts,
        "speculative": spec_rows, "kv_speed": kv_rows, "int8": int8_rows, "cpu_peers": peer_rows, "scale": scale_rows, "moe": moe_rows, "structured": structured_rows,
        "prefill": prefill_rows, "images": image_rows, "lora": lora_rows,
        "notes": {
            "tok_s": "useful output tokens (each row's own max_tokens) / generation seconds; static batches' padding steps do not count",
            "process_s": "process start (interpreter, imports, model load, warm-up) to ready, plus this workload's generation",
            "outside_fwd": "1 - model forward (incl. logits) time / engine step time, over all steps (share_at_64: steps with 64 rows)",
            "roofline": "tok/s / (bf16 matmul FLOP/s at the run's mean rows per step / (2 x matmul params per token)); "
                        "FLOP/s: the better of the timings at the start and at the end of the run",
            "vllm_reference": report.VLLM_REFERENCE,
        },
    }
    json_path = out_dir / f"results-{stamp}.json"
    png_path = out_dir / f"results-{stamp}.png"
    why = report.chart(png_path, rows) if rows else "no system results"
    result["chart"] = str(png_path) if why is None else f"not drawn: {why}"
    report.write_json(json_path, result)

    log("")
    if rows:
        log(report.table(rows))
        log("")
    if profiles:
        log("decode-step profiles (64 rows, W1 prompts; share of the step by op group):")
        for p in profiles:
            log(f"  {p['model']}, {p['warm_steps']} tokens after the prompts: " + profile.summary_line(p))
        log("")
    log("pipeline (input -> engine -> Arrow sink):")
    log(report.pipeline_text(pipe))
    log("")
    if spec_rows:
        log("speculative decoding (ngram; off / forced at every batch / as shipped):")
        log(speculative.text(spec_rows))
        log("")
    if kv_rows:
        log("quantized KV cache (native kernels; auto = bf16):")
        log(kv_speed.text(kv_rows))
        log("")
    if int8_rows:
        log("int8 compute vs bf16 (W1 on SmolLM2, whole process; GEMM rates per shape; quality vs bf16):")
        log(int8_speed.text(int8_rows))
        log("")
    if peer_rows:
        log("CPU peers (batchjob vs llama.cpp on this CPU; the machine's flags and ceilings):")
        log(cpu_peers.text(peer_rows))
        log("")
    if scale_rows:
        from batchjob.bench import scale

        log("scale rows (random real-shaped models, the same GGUF for batchjob and llama.cpp; issue 46):")
        log(scale.text(scale_rows))
        log("")
    if image_rows:
        log(images.text(image_rows))
        log("")
    if lora_rows:
        log(lora.text(lora_rows))
        log("")
    if moe_rows:
        log("MoE vs its dense equivalent (same active parameters):")
        log(moe.text(moe_rows))
        log("")
    if structured_rows:
        log("structured outputs (llguidance; target: at most 10% slower):")
        log(structured.job_text(structured_rows["job"]))
        log("")
    if prefill_rows:
        log("prefill-only jobs (embed: last-token pooling, normalised; score: prompt + continuation):")
        log(prefill.text(prefill_rows))
        log("")
    log("targets (issue 7):")
    log(report.targets_text(tgts))
    log("")
    log(f"wrote {json_path}" + (f" and {png_path}" if why is None else f" (no chart: {why})")
        + f" in {result['elapsed_s'] / 60:.1f} min; load average {info['loadavg_end'][0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
