"""Recording a job's persisted operations, then checking the crash states they allow: what was acknowledged
before the power went is there, and `batchjob run` (or `export`) run again finishes with every row once and
the uninterrupted run's text, a folder that verifies and an export that works."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.io import commit_log
from batchjob.io.disk import using
from batchjob.io.manifest import Manifest, ManifestError
from batchjob.io.parts import read_results
from batchjob.io.recovery import check_part
from tests.durability.crash_model import CrashState, crash_states, materialize
from tests.durability.forked import in_parts
from tests.durability.recorder import Recording, RecordingDisk

Command = Callable[[Path], list]  # the command line, given the folder the job writes under


def cli(args: list, code: int | None = 0):
    """`batchjob ARGS` in this process; `code=None`: any exit code, and an exception is caught and reported."""
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=code is None)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"batchjob {args[0]} raised {type(result.exception).__name__}: {result.exception}")
    if code is not None:
        assert result.exit_code == code, (args, result.output)
    return result


@dataclass
class Scenario:
    """A job whose operations are recorded: `before` runs first, unrecorded (a first run to resume), then
    `recorded`; a crash state is recovered by running `rerun`, and `check` says whether the root is right."""
    name: str
    recorded: list[Command]
    check: Callable[[Path], None]
    before: list[Command] = field(default_factory=list)
    prepare: Callable[[Path], None] | None = None  # after `before`, unrecorded: what a crash before left (a torn log)
    rerun: list[Command] | None = None  # default: the recorded commands again
    acked_files: list[str] = field(default_factory=list)  # files (under root) a recorded command's success promises


def record(scenario: Scenario, root: Path, monkeypatch, skip_sites: frozenset[str] = frozenset()) -> Recording:
    """Run the scenario under `root`, recording every persisted operation after `before`."""
    root.mkdir(parents=True, exist_ok=True)
    for command in scenario.before:
        cli(command(root))
    if scenario.prepare is not None:
        scenario.prepare(root)
    recorder = RecordingDisk(root, skip_sites)
    with using(recorder), acknowledging(recorder, monkeypatch):
        for command in scenario.recorded:
            cli(command(root))
            for name in scenario.acked_files:  # the command said it wrote these
                recorder.ack(("file", name, (root / name).read_bytes()))
    return recorder.recording


@contextmanager
def acknowledging(recorder: RecordingDisk, monkeypatch) -> Iterator[None]:
    """Inside: each commit-log append that returns (the commit the job acknowledges) is marked in the recording."""
    append = commit_log.CommitLog.append

    def acknowledged_append(log, record_):
        append(log, record_)
        part = record_.get("part")
        recorder.ack(("commit", str(log.path.parent.relative_to(recorder.root)), part and part["name"]))

    monkeypatch.setattr(commit_log.CommitLog, "append", acknowledged_append)
    try:
        yield
    finally:
        monkeypatch.setattr(commit_log.CommitLog, "append", append)


class Lost(AssertionError):
    """Something acknowledged as durable is not in the crash state."""


def check_acks(state: CrashState, folder: Path) -> None:
    """Every commit and file the job acknowledged before the crash is in the state, whole."""
    manifests: dict[str, Manifest | None] = {}
    for ack in state.acks:
        if ack[0] == "file":
            path = folder / ack[1]
            if not path.is_file() or path.read_bytes() != ack[2]:
                raise Lost(f"{ack[1]} was reported written, but after the crash it is "
                           f"{'missing' if not path.is_file() else 'different'}")
            continue
        where, part = ack[1], ack[2]
        if where not in manifests:
            try:
                manifests[where] = Manifest.load(folder / where)
            except ManifestError as e:
                raise Lost(f"{where}: the manifest of acknowledged commits does not load: {e}") from e
        manifest = manifests[where]
        if manifest is None:
            raise Lost(f"{where}: acknowledged commits, but no manifest.json after the crash")
        if part is None:
            continue
        listed = {p.name: p for p in manifest.parts}
        if part not in listed:
            raise Lost(f"{where}/{part}: committed, but not listed after the crash")
        problem = check_part(folder / where / part, listed[part])
        if problem is not None:
            raise Lost(f"{where}/{part}: committed, but {problem} after the crash")


@dataclass
class Outcome:
    states: int = 0
    failures: list[str] = field(default_factory=list)


def check_states(scenario: Scenario, recording: Recording, work: Path, *, limit: int | None = None,
                 stop_at_first: bool = False, every: int = 1, prefixes: Collection[int] | None = None,
                 parts: int | None = None) -> Outcome:
    """Build each crash state of `recording` (every `every`-th, at most `limit`, of the given prefixes or all),
    check its acknowledged commits, recover it and check the result. Failures are collected, not raised. The states
    are split over `parts` forked copies of this process (tests/durability/forked.py; default: one per usable CPU),
    state i to copy i % parts; `limit` and `stop_at_first` hold in each copy."""
    def part(k: int, count: int) -> Outcome:
        return _check_states(scenario, recording, work, limit, stop_at_first, every, prefixes, k, count)

    outcome = Outcome()
    for done in in_parts(part, parts):
        outcome.states += done.states
        outcome.failures += done.failures
    return outcome


def _check_states(scenario: Scenario, recording: Recording, work: Path, limit: int | None, stop_at_first: bool,
                  every: int, prefixes: Collection[int] | None, part: int, parts: int) -> Outcome:
    outcome = Outcome()
    for i, state in enumerate(crash_states(recording, prefixes=prefixes)):
        if i % every or i % parts != part:
            continue
        if limit is not None and outcome.states >= limit:
            break
        outcome.states += 1
        folder = work / f"state-{i}"
        materialize(state, folder)
        try:
            check_acks(state, folder)
            for command in scenario.rerun or scenario.recorded:
                result = cli(command(folder), code=None)
                if result.exit_code != 0:
                    raise AssertionError(f"the rerun exited {result.exit_code}: {result.output.strip()[-400:]}")
            scenario.check(folder)
        except Exception as e:  # noqa: BLE001 - every failure is reported with the state that caused it
            outcome.failures.append(f"{scenario.name}, after op {state.prefix} ({state.rule}): "
                                    f"{'' if isinstance(e, AssertionError) else type(e).__name__ + ': '}{e}")
            if stop_at_first:
                break
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            if outcome.states % 50 == 0:
                release_memory()
    return outcome


def fault_points(kinds: list[str], errnos: dict[int, tuple[str, ...]]) -> Iterator[tuple[int, int]]:
    """(errno, operation number) for each operation of `kinds` (1-based) that can meet each error, memory released
    every 50 (a run each)."""
    runs = 0
    for code, affected in errnos.items():
        for at, kind in enumerate(kinds, start=1):
            if kind in affected:
                runs += 1
                if runs % 50 == 0:
                    release_memory()
                yield code, at


def release_memory() -> None:
    """Hundreds of jobs in one process: a finished job's engine, feed and streams reference each other, so only
    a full collection frees them, and glibc keeps what is freed in its arenas. Without this every 50 jobs the
    suite's process grew past 18 GB (the crash states alone: 3.4 GB), with it it stays near 0.6 GB. A full
    collection of the test process (torch, transformers, the recordings) took 0.3-0.5 s; what survives one is
    frozen (gc.freeze: left out of later collections), so the next looks only at what the jobs since made."""
    import ctypes
    import gc

    gc.collect()
    gc.freeze()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def result_texts(out: Path) -> list[str]:
    """Each row's text by row_index; every row exactly once."""
    table = read_results(out)
    rows = table.column("row_index").to_pylist()
    assert sorted(rows) == list(range(len(rows))) and len(set(rows)) == len(rows), f"rows {sorted(rows)}"
    texts = dict(zip(rows, table.column("generated_text").to_pylist()))
    return [texts[i] for i in range(len(rows))]


def check_folder(out: Path, expected: list[str], export_to: Path) -> None:
    """The rows are the expected ones once each, the folder verifies, and an export holds them all in order."""
    got = result_texts(out)
    assert got == expected, f"{len(got)} rows, texts {'differ' if len(got) == len(expected) else 'missing'}"
    verify = cli(["verify", out], code=None)
    assert verify.exit_code == 0, f"verify: {verify.output.strip()}"
    cli(["export", out, "--to", export_to])
    import pyarrow.parquet as pq

    exported = pq.read_table(export_to)
    assert exported.column("generated_text").to_pylist() == expected, "the export differs"


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
