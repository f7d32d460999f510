"""Checks that run in a process of their own and need one core, started as soon as the session has collected the
test that reads them, so they run beside the rest of the suite instead of after it, at the lowest priority (nice 19):
they fill the time the in-process tests leave a core idle (the Triton interpreter is one Python thread for minutes).
The kernel builds, which other tests wait for, run at the tests' own priority (`nice`).
At nice 10 they still took a tenth of each core from the cluster tests while those kept both cores busy.
Nothing is skipped or weakened: the test waits for its process and asserts on its exit code and output as before;
a test run alone (or whose process was not started early) starts it itself."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@dataclass(eq=False)
class BackgroundRun:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # over the suite's environment
    timeout: float = 1800  # a hang guard from when the test starts waiting, never a timing assertion
    # 19: the lowest priority, for a check only its own test waits for (run last in the session). A run whose output
    # other tests wait for (the kernel builds: a test needing one waits on its lock) takes 0, as the tests do: at 19,
    # beside the process session, a test waited up to 47 s on a starved g++ holding the lock it needed
    nice: int = 19
    proc: subprocess.Popen | None = None
    _out: object = None
    _err: object = None
    _done: subprocess.CompletedProcess | None = None  # kept: several tests may read one run

    def start(self) -> None:
        if self.proc is None:
            self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            # at nice 19 it takes the cores the in-process tests leave idle (a test between subprocesses), not their
            # time; once a test waits for it, it has them all
            nice = ["nice", "-n", str(self.nice)] if self.nice and shutil.which("nice") else []
            self.proc = subprocess.Popen([*nice, *self.argv], cwd=REPO, env={**os.environ, **self.env},
                                         stdout=self._out, stderr=self._err, text=True)

    def result(self) -> subprocess.CompletedProcess:
        """The process's exit code and output, once it ends (started now if it was not yet)."""
        if self._done is not None:
            return self._done
        self.start()
        try:
            self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        out = []
        for f in (self._out, self._err):
            f.seek(0)
            out.append(f.read())
            f.close()
        self._done = subprocess.CompletedProcess(self.argv, self.proc.returncode, *out)
        return self._done

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def starts_early(run: BackgroundRun):
    """Marks a test whose `run` starts as soon as the session has collected it (tests/conftest.py)."""
    return pytest.mark.starts_early(run)


def start_collected(items: list[pytest.Item]) -> list[BackgroundRun]:
    """Start the early runs of the collected (selected) tests; returns them, to be stopped at the session's end."""
    runs = []
    for item in items:
        for mark in item.iter_markers("starts_early"):
            run = mark.args[0]
            if all(run is not r for r in runs):
                run.start()
                runs.append(run)
    return runs
