"""Checks that a source builds on every path, several at once: a path this CPU cannot run compiled only, one it runs
taken from the kernel cache (built there if missing); each compile is one g++ process, one core for seconds, so the
cases of a test go side by side on the machine's cores instead of one after another."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from batchjob.job.process.threads import usable_cpus
from batchjob.kernels.native.build import ISAS, build, compile_only, isa_runs_here


def compiled(source: str, defines: dict[str, int], isa: str) -> None:
    """`source` built for the `isa` path: the kernel cache's build where this CPU runs the path (the one the tests load,
    usually built already by tests/kernels/native_builds), a compile-only check where it cannot."""
    if isa_runs_here(isa):
        build(source, defines, isa=isa)
    else:
        compile_only(source, defines, isa)


def compile_each(cases: list[tuple[str, dict[str, int], str]]) -> None:
    """`compiled(source, defines, isa)` for every case, up to one per usable core at a time; raises the first case's
    BuildError (in the order given) once all have run."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(cases), usable_cpus()))) as pool:
        futures = [pool.submit(compiled, *case) for case in cases]
    for future in futures:
        future.result()


def compile_every_path(source: str, defines: dict[str, int]) -> None:
    """`source` built for each instruction-set path (ISAS: AVX-512, AVX2, generic), whichever this CPU runs."""
    compile_each([(source, defines, isa) for isa in ISAS])
