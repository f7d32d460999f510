"""How a duration reads to an operator: 45s, 3:07, 1:02:03 (progress lines, ETAs, `batchjob status`)."""
from __future__ import annotations


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}" if m else f"{s}s"
