"""A running job's stop signals (SIGINT, SIGTERM, SIGUSR1: drain, commit, exit 75).

On the first signal the job admits no new rows and lets the running ones finish for up to
`drain_timeout` seconds, then commits and exits with EXIT_RESUMABLE; rerunning the same command
continues. A second SIGINT raises KeyboardInterrupt at once (committed parts are all that count, so
nothing is corrupt); a second SIGTERM/SIGUSR1 ends the drain now and commits what finished.
"""
from __future__ import annotations

import os
import signal
import threading
import time

from batchjob.errors import EXIT_RESUMABLE

SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")


class StopSignals:
    def __init__(self, drain_timeout: float, situation=None, bar_shown=None) -> None:
        """`situation()`: what the first signal will do instead of a drain to exit 75, or None (a drain).
        `bar_shown()`: whether a progress bar holds the terminal's last line (the notice then starts a new one)."""
        self.drain_timeout = drain_timeout
        self.situation = situation
        self.bar_shown = bar_shown
        self.received: str | None = None  # name of the first signal
        self.deadline: float | None = None
        self.hurry = False
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Only from the main thread (Python delivers signals there); elsewhere signals keep their handlers."""
        if threading.current_thread() is not threading.main_thread():
            return
        for name in SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def request(self, name: str = "request") -> None:
        """Stop as on a first signal (what the handler does; also for tests and embedding)."""
        if self.received is None:
            self.received = name
            self.deadline = time.monotonic() + self.drain_timeout

    @property
    def stopping(self) -> bool:
        return self.received is not None

    def drain_over(self) -> bool:
        return self.hurry or (self.deadline is not None and time.monotonic() >= self.deadline)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.request(name)
            instead = self.situation() if self.situation else None
            # a new line first under a bar: written after it, the notice would run on from the bar's text (and
            # os.write, not tqdm.write: the handler may run inside the bar's own write, holding its lock)
            start = "\n" if self.bar_shown and self.bar_shown() else ""
            if instead:
                _say(f"{start}batchjob: {name}: {instead}\n")
            else:
                _say(f"{start}batchjob: {name}: admitting no new rows; finishing the running ones (up to "
                     f"{self.drain_timeout:g}s), then committing and exiting with {EXIT_RESUMABLE}. "
                     f"Rerun the same command to continue; SIGINT again stops at once.\n")
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            self.hurry = True


def _say(text: str) -> None:
    try:
        os.write(2, text.encode())  # not print(): a handler may run while the main code is printing
    except OSError:
        pass
