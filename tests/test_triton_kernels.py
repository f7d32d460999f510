"""The Triton kernels against their torch references under the interpreter (TRITON_INTERPRET=1): the
cases live in tests/triton_cases.py and run in a process of their own, because the flag must be set
before anything imports triton. On a GPU, `make gpu-check` runs the same cases on CUDA."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("triton")


def test_triton_kernels_match_their_references_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "tests.triton_cases", "--device", "cpu"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "all passed" in out.stdout
