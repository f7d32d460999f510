"""`make bench`'s int8 weight-matmul table (issue 25): SmolLM2-135M's GEMM shapes at 1-256 rows, each path
timed in the same rounds (taking turns, best of `reps`), with its rate in GOP/s (2 x rows x N x K per second):

- bf16: kernels/linear.py's Linear (oneDNN packed, AMX calls of 64 rows), what `--quantization none` runs;
- F.linear bf16: the raw oneDNN bf16 GEMM on the plain weight, one call (no row tiles);
- _int_mm: raw `torch._int_mm` int8 x int8 -> int32 on a [K, N] weight, the GEMM alone;
- int8 GEMM: the GEMM Int8Linear runs, alone (the native kernel's int32 sums on this CPU's path, kernels/native/csrc/scaled_mm.cpp);
- qlinear: raw oneDNN int8 inner product on a weight packed at load (`onednn.qlinear_prepack`), alone; only on
  a CPU with AMX-int8 (on AMD Zen 4 it takes 0.4-2 s per call: docs/design/int8-matmul.md);
- _int_mm+torch: the naive W8A8 path: the torch reference quantize, `_int_mm`, the torch rescale;
- int8: kernels/linear_int8.py's Int8Linear, what `--quantization int8` runs (one native call: quantize, GEMM,
  rescale).

    python -m batchjob.bench.int8_matmul [--rows 1,8,64,256] [--reps 15] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads x 64, 3 KV heads, vocab 49152 (N, K)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
PATHS = ("bf16", "F.linear bf16", "_int_mm", "int8 GEMM", "qlinear", "_int_mm+torch", "int8")


def _paths(n: int, k: int, rows: int, g: torch.Generator, copies: int) -> dict:
    """Each path over `copies` distinct weights (as the layers of a step: not hot in cache), one call each."""
    from batchjob.kernels import Linear
    from batchjob.kernels import Int8Linear
    from batchjob.kernels import cpu_identity
    from batchjob.kernels import quantize_rows_int8, quantize_weight_int8

    ws = [torch.randn(n, k, generator=g).mul(0.05).bfloat16() for _ in range(copies)]
    x = torch.randn(rows, k, generator=g).bfloat16()
    wqs = [quantize_weight_int8(w) for w in ws]
    wq_ts = [(wq.t().contiguous(), scale) for wq, scale in wqs]
    xq, _ = quantize_rows_int8(x)
    lins = [Linear(w) for w in ws]
    qlins = [Int8Linear(w) for w in ws]
    gemms = [Int8Linear(w) for w in ws]  # the GEMM alone: its own packed copies, not the ones int8 just read

    def each(fn, items):
        return lambda: [fn(item) for item in items]

    def naive(item):
        wq_t, scale = item
        q, s = quantize_rows_int8(x)
        return (torch._int_mm(q, wq_t).float() * s * scale).bfloat16()

    # torch 2.13's CPU _int_mm takes any shape (CUDA's wants rows > 16 and K, N multiples of 8)
    fns = {"bf16": each(lambda lin: lin(x), lins), "F.linear bf16": each(lambda w: F.linear(x, w), ws),
           "_int_mm": each(lambda item: torch._int_mm(xq, item[0]), wq_ts), "_int_mm+torch": each(naive, wq_ts),
           "int8": each(lambda lin: lin(x), qlins)}
    fns["int8 GEMM"] = each(lambda lin: lin.sums(xq), gemms)
    if "amx_int8" in cpu_identity()[1]:
        packed = [torch.ops.onednn.qlinear_prepack(wq, None) for wq, _ in wqs]
        unit, zero = torch.ones(n), torch.zeros(n, dtype=torch.int64)
        fns["qlinear"] = each(lambda p: torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, p, unit, zero, None, 1.0, 0,
                                                                            torch.float32, "none", [], ""), packed)
    return fns


def measure(rows=(1, 8, 64, 256), reps: int = 15, shapes=SHAPES, log=print) -> list[dict]:
    """One row per (shape, rows): best seconds per call and GOP/s of each path. A call's time is the mean over
    distinct weights (up to 16, about 32 MB of bf16 per path) so that weights come from memory as in a step."""
    g = torch.Generator().manual_seed(0)
    out = []
    for name, (n, k) in shapes.items():
        copies = max(1, min(16, (32 << 20) // (2 * n * k)))
        for m in rows:
            fns = _paths(n, k, m, g, copies)
            r = max(3, reps // 4) if n * m > 2 ** 22 else reps
            best = {p: float("inf") for p in fns}
            for rep in range(r + 1):  # round 0 warms up
                for p, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    if rep:
                        best[p] = min(best[p], (time.perf_counter() - t0) / copies)
            ops = 2 * m * n * k
            row = {"shape": name, "n": n, "k": k, "rows": m, "weights": copies,
                   "ms": {p: round(s * 1e3, 4) for p, s in best.items()},
                   "gops": {p: round(ops / s / 1e9, 1) for p, s in best.items()}}
            out.append(row)
            log(line(row))
    return out


def line(row: dict) -> str:
    ms, gops = row["ms"], row["gops"]
    cells = "  ".join(f"{p} {ms[p]:.3f} ms ({gops[p]:.0f})" for p in PATHS if p in ms)
    return f"  {row['shape']:7} {row['rows']:3} rows: {cells}  int8 x{ms['bf16'] / ms['int8']:.2f} vs bf16"


def text(rows: list[dict]) -> str:
    return "\n".join(line(r) for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchjob.bench.int8_matmul", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", type=Path, help="write the rows here (default: print them)")
    args = ap.parse_args(argv)
    rows = measure(tuple(int(r) for r in args.rows.split(",")), args.reps)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    else:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
