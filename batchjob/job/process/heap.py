"""The cyclic garbage collector during a run. A job allocates a few small objects per row (sequences,
result dicts, lists) that reference counting frees; the collector's full passes over the model's,
tokenizer's and engine's long-lived objects are pure cost (they cut the rows/s outside the forward from
~24k to ~17k in the pipeline benchmark). So a run freezes what exists when it starts (out of the
collector's view) and collects the young generation less often, and puts both back when it ends.
Loading a large manifest pauses the collector too (io/manifest.py)."""
from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000  # allocations (net of frees) between young collections; CPython's default is 700
OLD_THRESHOLD = 100  # middle-generation collections between full ones; default 10


class QuietCollector:
    def __init__(self) -> None:
        self._saved: tuple[int, int, int] | None = None

    def start(self) -> None:
        gc.freeze()  # no collect() first: it would walk a resumed job's 100,000 manifest entries; any garbage
        # frozen here is collected after stop() (the CLI's process ends anyway)
        self._saved = gc.get_threshold()
        young, middle, old = self._saved
        gc.set_threshold(max(young, YOUNG_THRESHOLD), middle, max(old, OLD_THRESHOLD))

    def stop(self) -> None:
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            gc.unfreeze()
            self._saved = None
