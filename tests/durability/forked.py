"""A sweep of independent checks split over forked copies of the test process, one per usable CPU. The crash-state and
mutation sweeps run hundreds of in-process jobs, each one Python thread for most of its time: one copy per core
(their jobs take one thread each, jobs.FAST's `--threads 1`) checks its share while the others check theirs. A fork
keeps what the test built (the recordings, the reference texts, the patched compaction size); what a copy reports
comes back through a pipe, and a copy that dies or raises fails the test with its traceback."""
from __future__ import annotations

import multiprocessing
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from batchjob.job.process.threads import usable_cpus

T = TypeVar("T")


def in_parts(work: Callable[[int, int], T], parts: int | None = None) -> list[T]:
    """`work(k, parts)` for k = 0 .. parts-1, each in a process forked from this one; their results in order.
    `parts`: the CPUs this process may use by default; one part runs here, unforked."""
    parts = parts or usable_cpus()
    if parts <= 1:
        return [work(0, 1)]
    ctx = multiprocessing.get_context("fork")
    running = []
    for k in range(parts):
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_part, args=(work, k, parts, send), name=f"part-{k}-of-{parts}", daemon=True)
        proc.start()
        send.close()
        running.append((receive, proc))
    results, problems = [], []
    for k, (receive, proc) in enumerate(running):
        try:
            ok, value = receive.recv()
        except EOFError:
            ok, value = False, "it ended without a report"
        proc.join()
        if not ok:
            problems.append(f"part {k} of {parts} (exit code {proc.exitcode}): {value}")
        results.append(value)
    assert not problems, "\n".join(problems)
    return results


def claim(folder: Path, key: str) -> bool:
    """True in the one copy that asks for `key` first (a file created exclusively in `folder`, which exists): a sweep
    of a few unequal items hands each to the first copy free for it, instead of splitting them up front, where one
    copy could get the slow ones and leave the other core idle."""
    try:
        os.close(os.open(folder / f"claim-{key}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _part(work: Callable[[int, int], T], k: int, parts: int, send) -> None:
    import torch

    # OpenMP's workers are not forked with the process: this copy's jobs run on one thread (the parent's pool,
    # used before the fork, would hang a parallel region here)
    torch.set_num_threads(1)
    try:
        send.send((True, work(k, parts)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test with it
        send.send((False, traceback.format_exc()))
    finally:
        send.close()
