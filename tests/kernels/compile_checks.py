"""Compile-only checks of paths this CPU may not run, several at once: each is one g++ process, one core for
seconds, so the cases of a test go side by side on the machine's cores instead of one after another."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from batchjob.job.process.threads import usable_cpus
from batchjob.kernels.native.build import ISAS, build, compile_only, isa_runs_here


def compile_each(cases: list[tuple[str, dict[str, int], str]]) -> None:
    """`compile_only(source, defines, isa)` for every case, up to one per usable core at a time; raises the first
    case's BuildError (in the order given) once all have run."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(cases), usable_cpus()))) as pool:
        futures = [pool.submit(compile_only, *case) for case in cases]
    for future in futures:
        future.result()


def compile_every_path(source: str, defines: dict[str, int]) -> None:
    """`source` compiled for each instruction-set path (ISAS: AVX-512, AVX2, generic), whichever this CPU runs: a path
    it runs is the kernel cache's build (the one the tests load, usually built already by tests/kernels/native_builds),
    a path it cannot run is compiled only."""
    runs = [isa for isa in ISAS if isa_runs_here(isa)]
    for isa in runs:
        build(source, defines, isa=isa)
    compile_each([(source, defines, isa) for isa in ISAS if isa not in runs])
