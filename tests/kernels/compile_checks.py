"""Compile-only checks of paths this CPU may not run, several at once: each is one g++ process, one core for
seconds, so the cases of a test go side by side on the machine's cores instead of one after another."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from batchjob.kernels.native.build import compile_only


def compile_each(cases: list[tuple[str, dict[str, int], str]]) -> None:
    """`compile_only(source, defines, isa)` for every case, up to one per usable core at a time; raises the first
    case's BuildError (in the order given) once all have run."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(cases), len(os.sched_getaffinity(0))))) as pool:
        futures = [pool.submit(compile_only, *case) for case in cases]
    for future in futures:
        future.result()
