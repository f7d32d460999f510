"""One line on stderr for what the operator should know (a kernel fallback, a slower path, a model's choice), as
`batchjob: ...`; every layer may say one through this leaf, beside errors.py (what stops a run)."""
from __future__ import annotations

import sys


def notice(message: str) -> None:
    print(f"batchjob: {message}", file=sys.stderr, flush=True)
