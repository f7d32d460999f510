"""`make test`: the suite as two pytest sessions side by side, so that the CPU the one leaves idle the other uses.

The tests that run processes of their own for most of their time (`PROCESS_TESTS`: the Ray and Slurm clusters, the
data-parallel and tensor-parallel ranks, the forked durability sweeps, whole `batchjob run` processes) wait on their
processes, events and polls: alone they kept about 1.5 of the 2 cores busy. The rest run in the other session (about
1.1 cores, with the background checks of tests/background.py beside them). One after the other, the suite left a
third of a core idle for its whole last part; side by side the two fill both cores (docs/contributing.md, the
measurements).
Every test runs, once, with its own fixtures; a session's failures fail the run. Run as one session, `pytest tests`
runs the same tests in one process, the process tests last (tests/conftest.py).

    python -m tests.run [PYTEST ARGS...]    (what `make test` runs: -q and the args go to both sessions)

The in-process session prints as it goes; the other's output follows once both have ended, then one line each.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROCESS_TESTS = ["tests/cluster/", "tests/durability/", "tests/engine/test_tensor_parallel.py",
                 # whole `batchjob run` processes: SIGKILLed at random moments, started from the checkout's root, the
                 # operator's lines and the checks made before torch is imported
                 "tests/job/test_chaos.py", "tests/kernels/test_name_clash.py", "tests/cli/test_operator.py",
                 "tests/cli/test_preflight.py",
                 # a job on the Triton kernels under the interpreter, image rows' job SIGKILLed and rerun: each a test
                 # that waits 15 s on its processes, which held the in-process session (the longer one) in the run
                 "tests/kernels/test_triton_kernels.py", "tests/images/test_llava_job.py"]
NO_TESTS = 5  # pytest's exit code when a session selected nothing


def sessions(args: list[str]) -> list[list[str]]:
    pytest = [sys.executable, "-m", "pytest", "-q", *args]
    rest = [f"--ignore={path}" for path in PROCESS_TESTS]
    return [[*pytest, "tests", *rest], [*pytest, *PROCESS_TESTS]]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    in_process, processes = sessions(args)
    with tempfile.TemporaryFile("w+") as log:
        other = subprocess.Popen(processes, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
        first = subprocess.Popen(in_process, cwd=REPO)
        try:
            results = {"in-process tests": first.wait(), "process tests": other.wait()}
        except KeyboardInterrupt:  # Ctrl-C in a terminal reaches both sessions; sent to this process only, pass it on
            for session in (first, other):  # each ends its tests and stops what it started (clusters, checks)
                try:
                    session.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    session.send_signal(signal.SIGINT)
            first.wait()
            other.wait()
            raise
        log.seek(0)
        print(f"\n==== the process tests, the session beside it ({len(PROCESS_TESTS)} folders and files, tests/run.py) ====",
              flush=True)
        sys.stdout.write(log.read())
    for name, code in results.items():
        print(f"{name}: {'passed' if code == 0 else 'no tests selected' if code == NO_TESTS else f'exit {code}'}")
    failed = [code for code in results.values() if code not in (0, NO_TESTS)]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main())
