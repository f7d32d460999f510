"""The Triton W8A8 kernels (kernels/triton/scaled_mm.py) against their torch references under the interpreter:
the `scaled mm` cases of tests/kernels/triton_cases.py, read from the interpreter run that
tests/kernels/test_triton_kernels.py starts early (the interpreter flag must be set before triton is imported, so
the cases run in a process of their own). On CUDA the same cases run in
`python -m tests.kernels.triton_cases --device cuda`."""
from __future__ import annotations

import pytest

from tests.background import starts_early
from tests.kernels.test_triton_kernels import TRITON_CASES

pytest.importorskip("triton")


@starts_early(TRITON_CASES)
def test_triton_scaled_mm_matches_the_reference_under_the_interpreter():
    out = TRITON_CASES.result()
    lines = [line for line in out.stdout.splitlines() if "scaled mm" in line]
    assert len(lines) == 8 and all(line.startswith("ok ") for line in lines), out.stdout[-4000:] + out.stderr[-4000:]
