"""Where a decode step's time goes: N rows of a workload decoding together, profiled with torch.profiler
over the model's named op groups (kernels/profiling.py: attention, linear, norm, rotary, ...).

    python -m batchjob.bench.decode_profile --model PATH [--kernels native] [--rows 64] [--steps 20]

Prints one `BENCH_PROFILE {json}` line: the mean step time, the mean context, and each group's share of
the step (what no group covers, Python and the engine's bookkeeping, is "other")."""
from __future__ import annotations

import argparse
import json
import sys
import time

MARK = "BENCH_PROFILE "
GROUPS = ("attention", "linear", "norm", "rotary", "kv_store", "silu_mul", "residual", "logits", "sampler", "prepare")


def profile_decode(model_path: str, kernels: str = "auto", rows: int = 64, steps: int = 20, warm_steps: int = 64,
                   workload: str = "W1", dtype: str | None = None, quantization: str = "none") -> dict:
    import torch

    from batchjob.bench.workloads import make
    from batchjob.device import choose_dtype
    from batchjob.engine.engine import Engine, EngineConfig
    from batchjob.engine.sample.row_keys import row_key
    from batchjob.engine.core.scheduler import SchedulerConfig
    from batchjob.engine.params import SamplingParams
    from batchjob.engine.core.sequence import Sequence
    from batchjob.models.registry import build_model
    from batchjob.models.loader import load_model

    torch_dtype = choose_dtype(dtype, "cpu")
    loaded = load_model(model_path, dtype=torch_dtype)
    model = build_model(loaded.config, loaded.weights, torch_dtype, kernels=kernels, quantization=quantization)
    engine = Engine(model, [], EngineConfig(scheduler=SchedulerConfig(max_num_seqs=rows)))
    wl = make(workload).head(rows)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True)  # nobody finishes while we look
    vocab = loaded.config.vocab_size  # a small test model: the workload's ids folded into its vocabulary
    for i, r in enumerate(wl.rows):
        engine.add(Sequence(i, [t % vocab for t in r.prompt], params, rng_key=row_key(0, i)))
    for _ in range(10_000):  # prefill everything, then decode a while so that contexts are mid-run
        engine.step()
        st = engine.last_stats
        if st is not None and st.num_prefill_tokens == 0 and st.num_seqs == len(wl.rows):
            break
    for _ in range(warm_steps):
        engine.step()
    wall = 0.0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            wall += time.perf_counter() - t
    totals = {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages() if e.key in GROUPS}
    # profiling itself slows the step down; the shares are of the profiled step
    shares = {g: totals.get(g, 0.0) / wall for g in GROUPS}
    shares["other"] = max(0.0, 1 - sum(shares.values()))
    # the same steps without the profiler: the step time to quote
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = (time.perf_counter() - t) / steps * 1e3
    contexts = [s.num_tokens for s in engine.scheduler.running]
    return {"kernels": model.kernels.name, "dtype": str(torch_dtype).removeprefix("torch."), "quantization": quantization,
            "rows": len(contexts),
            "threads": torch.get_num_threads(), "mean_context": sum(contexts) / max(1, len(contexts)),
            "step_ms": step_ms, "profiled_step_ms": wall / steps * 1e3, "shares": shares}


def summary_line(p: dict) -> str:
    shares = sorted(p["shares"].items(), key=lambda kv: -kv[1])
    q = "" if p.get("quantization", "none") == "none" else f" {p['quantization']} matmuls"
    return (f"{p['kernels']} {p['dtype']}{q}, {p['rows']} rows, mean context {p['mean_context']:.0f}: step {p['step_ms']:.1f} ms; "
            + ", ".join(f"{k} {v:.0%}" for k, v in shares if v >= 0.005))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m batchjob.bench.decode_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--quantization", default="none", choices=["none", "int8"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--warm-steps", type=int, default=64, help="decode steps after the prompts before profiling")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out = profile_decode(args.model, args.kernels, args.rows, args.steps, warm_steps=args.warm_steps, dtype=args.dtype,
                         quantization=args.quantization)
    print(MARK + json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
