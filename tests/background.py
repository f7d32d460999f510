"""Checks that run in a process of their own, started as soon as the session has collected the test that reads them,
so they run beside the rest of the suite instead of after it: the Triton interpreter (one Python thread for minutes)
and the native kernel builds (one g++ per core). They run at the tests' own priority. At nice 19 the builds starved
beside the process session while tests waited on their locks (one test 47 s), and the interpreter checks got so
little CPU that the session's last test waited 120-136 s for them with one core busy; at the same priority they end
mid-run and the suite's end has no single-threaded tail.
Nothing is skipped or weakened: the test waits for its process and asserts on its exit code and output as before;
a test run alone (or whose process was not started early) starts it itself."""
from __future__ import annotations

import os
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
    proc: subprocess.Popen | None = None
    _out: object = None
    _err: object = None
    _done: subprocess.CompletedProcess | None = None  # kept: several tests may read one run

    def start(self) -> None:
        if self.proc is None:
            self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            self.proc = subprocess.Popen(self.argv, cwd=REPO, env={**os.environ, **self.env},
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
