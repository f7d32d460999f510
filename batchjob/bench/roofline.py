"""The matmul-only ceiling: how fast this machine runs the model's own weight matmuls, timed with torch at
the start of the run, and the tokens/s that allows at the batch sizes a run used. Attention, norms,
sampling and scheduling are left out, so no torch engine on this machine can beat it.

Two timings per batch size:
- `flops` (the ceiling used): one distinct weight per matmul, as in the model (SmolLM2's 270 MB of bf16
  weights stream from memory every step), each in the layout the engine uses (`kernels.Linear`: oneDNN's
  packed layout for bf16 where the CPU supports it).
- `flops_hot`: the same shapes with one shared weight per shape and `F.linear`, so the weights stay in
  cache. It is higher at small batches (no memory traffic) and is kept for comparison only."""
from __future__ import annotations

import bisect
import math
import time

import torch

from batchjob.bench.models import ModelSpec

BATCHES = (1, 4, 16, 32, 64, 128, 256)


def _weights(spec: ModelSpec, dtype: torch.dtype, hot: bool) -> list:
    from batchjob.kernels import Linear

    g = torch.Generator().manual_seed(0)
    if hot:
        shared = {shape: torch.randn(shape[1], shape[0], generator=g).to(dtype) for shape in set(spec.matmul_shapes())}
        return [(shape[0], Linear(shared[shape], pack=False)) for shape in spec.matmul_shapes()]
    return [(shape[0], Linear(torch.randn(shape[1], shape[0], generator=g).to(dtype))) for shape in spec.matmul_shapes()]


def time_matmuls(spec: ModelSpec, rows: int, dtype: torch.dtype, min_s: float = 0.3, reps: int = 3,
                 hot: bool = False, weights: list | None = None) -> float:
    """Seconds for one pass of `rows` tokens through every weight matmul of the model (lm_head included):
    the best of `reps` timings of at least `min_s` each (a ceiling: other load on the machine only slows it)."""
    g = torch.Generator().manual_seed(1)
    weights = weights or _weights(spec, dtype, hot)
    x = {h: torch.randn(rows, h, generator=g).to(dtype) for h in {i for i, _ in spec.matmul_shapes()}}

    def once():
        for width, linear in weights:
            linear(x[width])

    with torch.inference_mode():
        once()  # warm-up: oneDNN picks and caches its kernels
        best = math.inf
        for _ in range(reps):
            n, start = 0, time.perf_counter()
            while True:
                once()
                n += 1
                elapsed = time.perf_counter() - start
                if elapsed >= min_s:
                    break
            best = min(best, elapsed / n)
        return best


def measure(spec: ModelSpec, dtype: torch.dtype, batches=BATCHES) -> dict:
    """{"flops": {rows: FLOP/s}, "ceiling_tok_s": {rows: tokens/s}} for one model and dtype."""
    flops, ceiling, hot = {}, {}, {}
    per_token = 2 * spec.matmul_params
    model_weights, hot_weights = _weights(spec, dtype, hot=False), _weights(spec, dtype, hot=True)
    for m in batches:
        t = time_matmuls(spec, m, dtype, weights=model_weights)
        flops[m] = per_token * m / t
        ceiling[m] = m / t
        hot[m] = per_token * m / time_matmuls(spec, m, dtype, weights=hot_weights)
    return {"model": spec.name, "dtype": str(dtype).removeprefix("torch."), "matmul_params": spec.matmul_params,
            "flops": flops, "ceiling_tok_s": ceiling, "flops_hot": hot}


def flops_at(table: dict, rows: float) -> float:
    """FLOP/s at `rows` rows per matmul, interpolated in log(rows) between the measured batch sizes."""
    pts = sorted((int(k), v) for k, v in table["flops"].items())
    xs = [p[0] for p in pts]
    if rows <= xs[0]:
        return pts[0][1] * rows / xs[0]  # below the smallest batch: FLOP/s scales with rows (weight-bound)
    if rows >= xs[-1]:
        return pts[-1][1]
    i = bisect.bisect_left(xs, rows)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    w = (math.log(rows) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + w * (y1 - y0)


def ceiling(table: dict, spec: ModelSpec, output_tokens: int, extra: dict) -> dict:
    """Ceiling tokens/s for a batchjob run, two ways:
    - `at_mean_batch`: FLOP/s at the run's mean rows per step / (2 x matmul params per token);
    - `per_step`: every step's matmuls (all its tokens through the layers, one lm_head row per row) at that
      step's own sizes, summed; output tokens / that time. This one also charges the prefill work."""
    mean_rows = extra["mean_seqs_per_step"]
    at_mean = flops_at(table, mean_rows) / (2 * spec.matmul_params)
    head = spec.hidden * spec.vocab
    t = 0.0
    for key, count in extra["step_histogram"].items():
        seqs, tokens = (int(v) for v in key.split(","))
        t += count * (2 * spec.matmul_params_no_head * tokens / flops_at(table, tokens) + 2 * head * seqs / flops_at(table, seqs))
    return {"mean_rows_per_step": mean_rows, "flops_at_mean_batch": flops_at(table, mean_rows),
            "at_mean_batch_tok_s": at_mean, "per_step_tok_s": output_tokens / t if t else None}
