"""How a size in bytes reads to an operator: 812 KiB, 196 MiB, 12.5 MiB, 1.42 GiB (the start line's KV cache, a
run's peak RSS in its final line and in `batchjob status`)."""
from __future__ import annotations

MIB, GIB = 1 << 20, 1 << 30


def format_bytes(n: int | float) -> str:
    if n >= 1000 * MIB:  # 1.00 GiB, not 1024 MiB
        return f"{n / GIB:.2f} GiB"
    if n >= 100 * MIB:
        return f"{n / MIB:.0f} MiB"
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.0f} KiB"
