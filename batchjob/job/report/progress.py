"""What a running job shows while it runs: on a terminal a progress bar that moves every step, elsewhere
(Slurm logs, cron, `> log`) a plain line every `log_every` seconds. Both count the whole job (rows
committed before this run included), tell committed rows from rows in flight, and estimate the time
left from this run's rate. When the number of rows is unknown (JSONL read for the first time), the rows
known are estimated from the input read so far (rows per byte, exact once the whole input is read), and
progress is rows finished of those."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from batchjob.io.durations import format_duration


@dataclass(slots=True)
class Snapshot:
    rows_done: int  # rows finished so far, the whole job (committed before this run + written in it)
    rows_committed: int  # of those, committed (in a part listed by the manifest)
    rows_in_flight: int  # given to the engine, not finished
    tokens: int  # tokens generated in this run
    bytes_read: int | None = None  # input position, when progress is by bytes
    rows_read_ahead: int = 0  # of the rows in flight, those waiting in the engine (read ahead), not yet computing


class Progress:
    def __init__(self, *, total_rows: int | None, rows_before: int, log_every: float, enabled: bool = True,
                 tty: bool | None = None, total_bytes: int | None = None, bytes_before: int = 0, stream=None,
                 clock=time.monotonic) -> None:
        self.total_rows, self.rows_before = total_rows, rows_before
        self.total_bytes, self.bytes_before = (total_bytes, bytes_before) if total_rows is None else (None, 0)
        self.log_every = log_every
        self.stream = stream or sys.stderr
        self.clock = clock
        self.t0 = self.last_line = clock()
        tty = self.stream.isatty() if tty is None else tty
        self.bar = None
        self.lines = enabled and not tty
        if enabled and tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total_rows, initial=rows_before, unit="row", desc="batchjob",
                            dynamic_ncols=True, file=self.stream)

    def update(self, s: Snapshot) -> None:
        """Called once per engine step: cheap unless it is time to draw."""
        now = self.clock()
        if self.bar is not None:
            self.bar.n = s.rows_done
            if self.total_rows is None:
                self.bar.total = self.known_rows(s)[0]  # None until some input is read: tqdm counts up
            self.bar.set_postfix_str(self._postfix(s, now), refresh=False)
            self.bar.refresh() if now - self.last_line >= 0.5 else None
            if now - self.last_line >= 0.5:
                self.last_line = now
        elif self.lines and now - self.last_line >= self.log_every:
            self.last_line = now
            print(f"batchjob: progress: {self.line(s, now)}", file=self.stream, flush=True)

    def _postfix(self, s: Snapshot, now: float) -> str:
        elapsed = max(now - self.t0, 1e-9)
        return f"{s.tokens / elapsed:,.0f} tok/s, {s.rows_committed:,} committed, {_in_flight(s)}"

    def known_rows(self, s: Snapshot) -> tuple[int | None, bool]:
        """(the job's rows as far as known, whether that is exact): the input's count when known; else,
        for a JSONL input, the rows read so far scaled by the bytes left (exact once it is all read)."""
        if self.total_rows is not None:
            return self.total_rows, True
        if not self.total_bytes or s.bytes_read is None:
            return None, False
        rows_read = s.rows_done - self.rows_before + s.rows_in_flight  # by this run: finished or in the engine
        if s.bytes_read >= self.total_bytes:
            return s.rows_done + s.rows_in_flight, True
        read = s.bytes_read - self.bytes_before
        if read <= 0 or rows_read <= 0:
            return None, False
        return self.rows_before + round(rows_read * (self.total_bytes - self.bytes_before) / read), False

    def line(self, s: Snapshot, now: float | None = None) -> str:
        """rows done/total (percent), rows/s, tok/s, committed, running, read ahead, ETA: for logs and tests."""
        now = self.clock() if now is None else now
        elapsed = max(now - self.t0, 1e-9)
        run_rows = s.rows_done - self.rows_before
        rate = run_rows / elapsed
        parts = []
        known, exact = self.known_rows(s)
        if known is not None:
            share = s.rows_done / known if known else 1.0
            parts.append(f"{s.rows_done:,}/{'' if exact else '~'}{known:,} rows ({share:.1%})")
            eta = max(0, known - s.rows_done) / rate if rate > 0 else None
        else:
            parts.append(f"{s.rows_done:,} rows")
            eta = None
        parts += [f"{rate:,.1f} rows/s", f"{s.tokens / elapsed:,.0f} tok/s", f"{s.rows_committed:,} committed",
                  _in_flight(s), f"ETA {format_duration(eta)}" if eta is not None else "ETA ?"]
        return ", ".join(parts)

    def say(self, line: str) -> None:
        """A line for the operator while the job runs (above the bar on a terminal)."""
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _in_flight(s: Snapshot) -> str:
    """The rows in the engine: those computing (at most max_num_seqs) apart from those read ahead, waiting."""
    return f"{s.rows_in_flight - s.rows_read_ahead:,} running, {s.rows_read_ahead:,} read ahead"
