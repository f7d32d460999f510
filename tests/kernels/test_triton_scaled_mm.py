"""The Triton W8A8 kernels (kernels/triton/scaled_mm.py) against their torch references under the interpreter:
the `scaled mm` cases of tests/kernels/triton_cases.py, in a process of their own (the interpreter flag must be
set before triton is imported). On CUDA the same cases run in `python -m tests.kernels.triton_cases --device cuda`."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("triton")


def test_triton_scaled_mm_matches_the_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "tests.kernels.triton_cases", "--device", "cpu", "-k", "scaled mm"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert out.stdout.count("ok ") == 8 and "all passed" in out.stdout, out.stdout
