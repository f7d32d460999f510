"""I/O errors are failures, not warnings: EIO, ENOSPC (a short write first, where it is a write) and EROFS
injected through the disk layer at each operation a job persists. The job ends with one clear line and a
non-zero exit, nothing it acknowledged is lost even if the power went right after (the crash model's
synced-only state), and once the fault is gone the same command finishes with every row once and the
uninterrupted run's text. Only the diagnostics (the lock's PID line, stats.jsonl) may fail without
stopping the job."""
from __future__ import annotations

import errno
import os
from pathlib import Path

from batchjob.io.disk import using
from tests.durability.crash_model import Model
from tests.durability.forked import in_parts
from tests.durability.harness import acknowledging, check_acks, check_folder, cli, fault_points, materialize
from tests.durability.jobs import job, responses
from tests.durability.recorder import FaultyDisk

# which errors each operation can meet on a real disk
ERRNOS = {
    errno.EIO: ("open", "write", "fsync", "ftruncate", "rename", "link", "unlink", "make_dir", "fsync_dir"),
    errno.ENOSPC: ("open", "write", "ftruncate", "rename", "link", "make_dir"),
    errno.EROFS: ("open", "ftruncate", "rename", "link", "unlink", "make_dir"),
}


def diagnostic(failed: str) -> bool:
    """Best effort by design, so a full disk does not stop a job over them: stats.jsonl, and the PID line
    written into the lock file once it is held (taking the lock is no diagnostic)."""
    kind, path = failed.split(" ", 1)
    return path.endswith("stats.jsonl") or (path.endswith(".lock") and kind in ("write", "ftruncate"))


def sink_writers() -> int:
    import threading

    return sum(1 for t in threading.enumerate() if t.name.startswith("batchjob-sink"))


def operations(model, src, root: Path) -> list[str]:
    """The kinds of the primitives a whole job calls, in order (a run with a fault that never fires)."""
    root.mkdir()
    disk = FaultyDisk(root, at=0, errno_=errno.EIO)
    with using(disk):
        cli(job(model, src)(root))
    return disk.kinds


def test_an_io_error_at_every_write_point_stops_the_job_cleanly_and_a_rerun_completes(model, inputs, reference,
                                                                                      tmp_path, monkeypatch):
    texts = reference[0]
    kinds = operations(model, inputs[0], tmp_path / "count")
    assert len(kinds) > 40, kinds

    def sweep(part: int, parts: int) -> tuple[int, list[str]]:  # fault point n in forked copy n % parts
        problems, runs = [], 0
        for n, (code, at) in enumerate(fault_points(kinds, ERRNOS)):
            if n % parts != part:
                continue
            runs += 1
            root = tmp_path / f"{errno.errorcode[code]}-{at}"
            root.mkdir()
            disk = FaultyDisk(root, at=at, errno_=code)
            writers = sink_writers()
            try:
                with using(disk), acknowledging(disk, monkeypatch):
                    result = cli(job(model, inputs[0])(root), code=None)
            except AssertionError as e:  # an exception escaped: a traceback, not a clear line
                problems.append(f"{errno.errorcode[code]} at op {at} ({disk.failed}): {e}")
                continue
            where = f"{errno.errorcode[code]} at op {at} ({disk.failed})"
            try:
                assert disk.failed is not None, "the fault never fired: the job took another path"
                assert sink_writers() == writers, "a sink's writer thread outlived the failed job"
                lines = [line for line in result.output.splitlines() if line.startswith("batchjob: error")]
                if diagnostic(disk.failed):
                    assert result.exit_code == 0, f"a diagnostic write stopped the job: {result.output[-300:]}"
                else:
                    assert result.exit_code != 0, "the job exited 0 after an I/O error"
                    assert len(lines) == 1 and "internal error" not in lines[0], result.output[-600:]
                    assert "Traceback" not in result.output
                    assert os.strerror(code) in lines[0], lines[0]
                # nothing acknowledged that a power cut right now would take away
                model_ = Model(disk.recording)
                for op in disk.recording.ops:
                    model_.apply(op)
                synced = model_.state(len(disk.recording.ops), "only the synced",
                                      names={p: [False] * len(f.pending) for p, f in model_.folders.items()},
                                      data={i: [False] * len(f.pending) for i, f in model_.files.items()})
                materialize(synced, tmp_path / f"synced-{part}")
                check_acks(synced, tmp_path / f"synced-{part}")
                # the fault is gone: the same command finishes the job
                rerun = cli(job(model, inputs[0])(root), code=None)
                assert rerun.exit_code == 0, f"the rerun failed: {rerun.output[-400:]}"
                check_folder(root / "out", texts, root / "check.parquet")
            except AssertionError as e:
                problems.append(f"{where}: {e}")
            finally:
                import shutil

                shutil.rmtree(tmp_path / f"synced-{part}", ignore_errors=True)
                shutil.rmtree(root, ignore_errors=True)
        return runs, problems

    done = in_parts(sweep)
    runs, problems = sum(r for r, _ in done), [p for _, found in done for p in found]
    print(f"{runs} faults injected")
    assert not problems, f"{len(problems)} of {runs} faults:\n" + "\n".join(problems[:25])


def test_an_io_error_at_every_write_point_of_an_export_is_one_line_and_the_export_then_works(model, inputs, reference,
                                                                                           tmp_path):
    """Both exports, rows and OpenAI Batch responses: before the fix a failing fsync printed a traceback."""
    texts, answers = reference
    cli(job(model, inputs[0])(tmp_path))
    cli(job(model, inputs[1], "--output-format", "openai-batch", out="batch")(tmp_path))
    exports = {"rows": lambda to: ["export", tmp_path / "out", "--to", to / "all.parquet"],
               "openai-batch": lambda to: ["export", tmp_path / "batch", "--format", "openai-batch", "--to",
                                           to / "responses.jsonl"]}
    problems, runs = [], 0
    for name, command in exports.items():
        (tmp_path / f"count-{name}").mkdir()  # as the fault runs' parent: the same operations follow
        count = FaultyDisk(tmp_path / f"count-{name}", at=0, errno_=errno.EIO)
        with using(count):
            cli(command(tmp_path / f"count-{name}" / "to"))
        for code, at in fault_points(count.kinds, ERRNOS):
            runs += 1
            to = tmp_path / f"{name}-{errno.errorcode[code]}-{at}"
            disk = FaultyDisk(to.parent, at=at, errno_=code)
            with using(disk):
                result = cli(command(to), code=None)
            try:
                assert disk.failed is not None, "the fault never fired"
                lines = [line for line in result.output.splitlines() if line.startswith("batchjob: error")]
                assert result.exit_code == 1 and len(lines) == 1, result.output[-400:]
                assert "Traceback" not in result.output and "internal error" not in lines[0], lines[0]
                assert os.strerror(code) in lines[0], lines[0]
                assert not [p for p in (to.iterdir() if to.is_dir() else []) if p.name.startswith(".")], \
                    "a temp file was left behind"
                cli(command(to))  # the fault is gone
                if name == "rows":
                    import pyarrow.parquet as pq

                    assert pq.read_table(to / "all.parquet").column("generated_text").to_pylist() == texts
                else:
                    assert responses(to / "responses.jsonl") == answers
            except AssertionError as e:
                problems.append(f"export {name}, {errno.errorcode[code]} at op {at} ({disk.failed}): {e}")
    print(f"{runs} faults injected into exports")
    assert not problems, f"{len(problems)} of {runs} faults:\n" + "\n".join(problems[:25])
