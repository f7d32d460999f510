"""Where the benchmarks read their sample data and keep what they build (models, llama.cpp, quantized files, reports).

One place, so a benchmark run from any directory finds the same cache:
- `CACHE`: `$BATCHJOB_BENCH_CACHE` when set; else a source checkout's `bench/cache` (where `make bench-llama-cpp`
  builds llama.cpp, and where earlier runs left their models); else `~/.cache/batchjob/bench` (`$XDG_CACHE_HOME`
  honoured) for an installed package, which has no checkout to write into.
- `ROOT`: the source checkout (the sample prompts under `jobs/data/`, the test cases gpu-check runs).
"""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _cache() -> Path:
    named = os.environ.get("BATCHJOB_BENCH_CACHE")
    if named:
        return Path(named).expanduser().resolve()
    if (ROOT / "Makefile").is_file() and (ROOT / "pyproject.toml").is_file():
        return ROOT / "bench" / "cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchjob" / "bench"


CACHE = _cache()
PROMPTS = ROOT / "jobs" / "data" / "prompts.jsonl"
PERPLEXITY_TEXT = ROOT / "jobs" / "data" / "perplexity.txt"
# reports (results-<date>.json and .png, gpu-check's files): a checkout's bench/, else beside the cache
REPORTS = ROOT / "bench" if CACHE == ROOT / "bench" / "cache" else CACHE / "reports"
