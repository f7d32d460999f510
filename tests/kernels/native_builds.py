"""The native kernel builds the suite's tests load, compiled into the kernel cache side by side (one g++ per usable
core) in a process of its own, started as soon as the session has collected a native kernel test, at the tests' own
priority: they wait on its locks (tests/background.py). Each build is a g++ of 2-22 s on one core; compiled one at a
time where a test first needed it, they kept the other core idle for about 250 s of a run. The cache is the one the
tests read ($BATCHJOB_CACHE_DIR or the user's), its lock files let a test that gets there first build a key itself
while this process waits for it, and a build missing from this list is still compiled by the test that needs it: the
list only decides what is ready early.

    python -m tests.kernels.native_builds
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

from batchjob.job.process.threads import usable_cpus
from batchjob.kernels.native.build import BuildError, build
from batchjob.kernels.reference.kv_quant import group4
from tests.kernels.native_cases import BEST_ISA, RUNNABLE_ISAS

# (head_dim, GQA group) of paged attention: the native tests' shapes and the tiny and SmolLM2 models' (head_dim 16,
# 32, 64), all on the best path this CPU runs, the lower paths' cases on each lower path
ATTENTION_BEST = [(16, 1), (16, 2), (32, 2), (64, 1), (64, 2), (64, 3), (80, 2), (80, 5), (96, 4), (96, 7), (128, 6),
                  (128, 8), (256, 2)]
ATTENTION_LOWER = [(16, 1), (64, 1), (64, 2), (64, 3), (80, 2), (80, 5), (128, 8), (256, 2)]
# the same over an int8/int4 cache (paged_attention_quant.cpp and kv_quant_store.cpp)
QUANT_BEST = [(16, 2), (64, 3), (80, 5), (96, 4), (128, 8), (256, 2)]
QUANT_LOWER = [(64, 3)]
WHOLE = ["fused.cpp", "scaled_mm.cpp", "quant_blocks.cpp"]  # one build per path


# what the tiny test models (head_dim 16, and Qwen3's 32; GQA 2) and the embedded SmolLM2 (Q4_1 weights computed as
# stored; head_dim 64, GQA 3) load on the best path: the session's first tests run them, and waited 20-30 s on the
# builds queued before them
FIRST = [("paged_attention.cpp", {"HEAD_DIM": 16, "GQA": 2}), ("fused.cpp", {}), ("paged_attention.cpp", {"HEAD_DIM": 32, "GQA": 2}),
         ("quant_blocks.cpp", {}), ("paged_attention.cpp", {"HEAD_DIM": 64, "GQA": 3})]


def builds() -> list[tuple[str, dict[str, int], str]]:
    """(source, defines, isa) of every build: the tiny models' first, then the slowest first (the quantized attention
    on every path, then the whole files, then plain attention)."""
    quant, whole, plain = [], [], []
    for isa in RUNNABLE_ISAS:
        best = isa == BEST_ISA
        for hd, g in QUANT_BEST if best else QUANT_LOWER:
            shape = {"HEAD_DIM": hd, "GQA": g, "GROUP": group4(hd)}
            quant += [("paged_attention_quant.cpp", shape, isa), ("kv_quant_store.cpp", shape, isa)]
        whole += [(source, {}, isa) for source in WHOLE]
        plain += [("paged_attention.cpp", {"HEAD_DIM": hd, "GQA": g}, isa)
                  for hd, g in (ATTENTION_BEST if best else ATTENTION_LOWER)]
    first = [(source, defines, BEST_ISA) for source, defines in FIRST]
    return first + [case for case in quant + whole + plain if case not in first]


def main() -> int:
    failed = 0

    def one(case):
        source, defines, isa = case
        t = time.perf_counter()
        build(source, defines, isa=isa)
        return time.perf_counter() - t

    cases = builds()
    with ThreadPoolExecutor(max_workers=max(1, usable_cpus())) as pool:
        futures = [pool.submit(one, case) for case in cases]
        for (source, defines, isa), future in zip(cases, futures):
            name = f"{source} {isa} {' '.join(f'{k.lower()}={v}' for k, v in sorted(defines.items()))}".rstrip()
            try:
                print(f"ok   {name} ({future.result():.1f} s)", flush=True)
            except BuildError as e:
                failed += 1
                print(f"FAIL {name}: {e}", flush=True)
    print(f"{failed} failed" if failed else f"all {len(cases)} built", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
