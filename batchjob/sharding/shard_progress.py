"""A sharded job's progress as a driver that runs no rows itself sees it (`batchjob ray submit`): rows done of the
total, tokens/s and ETA over all shards, read from the shards' manifests in the shared output folder (nothing comes
through the scheduler). On a terminal a bar redrawn every second; elsewhere (logs, cron) a plain line every
`log_every` seconds."""
from __future__ import annotations

import sys
import time

from batchjob.sharding.sharded_output import ShardError, sharded_status
from batchjob.io.durations import format_duration

BAR_EVERY_S = 1.0


class ShardProgress:
    def __init__(self, output, *, log_every: float = 30.0, tty: bool | None = None, stream=None,
                 clock=time.monotonic) -> None:
        self.output = output
        self.log_every = log_every
        self.stream = stream or sys.stderr
        self.clock = clock
        self.last = clock()
        self.bar = None
        if self.stream.isatty() if tty is None else tty:
            from tqdm import tqdm

            self.bar = tqdm(total=None, unit="row", desc="batchjob", dynamic_ncols=True, file=self.stream,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} rows "
                                       "[{elapsed}{postfix}]")

    def tick(self, force: bool = False) -> None:
        """Called often: reads the manifests when it is time to draw (or `force`)."""
        now = self.clock()
        if not force and now - self.last < (BAR_EVERY_S if self.bar is not None else self.log_every):
            return
        self.last = now
        status = self.status()
        if self.bar is None:
            self.say(f"batchjob: {line(status)}")
            return
        if status is not None:
            self.bar.total = status["total_rows"]
            self.bar.n = status["rows_done"]
            self.bar.set_postfix_str(details(status), refresh=False)
        self.bar.refresh()

    def status(self) -> dict | None:
        try:
            return sharded_status(self.output, slurm=False)
        except ShardError:  # no shard has planned the job yet
            return None

    def say(self, text: str) -> None:
        """A line for the operator (above the bar on a terminal)."""
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """The last state: the bar at its end, or a last line."""
        self.tick(force=True)
        if self.bar is not None:
            self.bar.close()


def details(st: dict) -> str:
    """Tokens/s, ETA and running shards, over all shards."""
    running = sum(s["state"] == "running" for s in st["shard_states"])
    parts = [f"{st['tokens_per_s']:,.0f} tok/s" if st["tokens_per_s"] else None,
             f"{st['rows_per_s']:,.1f} rows/s" if st["rows_per_s"] else None,
             f"ETA {format_duration(st['eta_s'])}" if st["eta_s"] else None,
             f"{running} of {st['shards']} shards running"]
    return ", ".join(p for p in parts if p)


def line(st: dict | None) -> str:
    """The plain progress line: rows done of the total (percent), then details()."""
    if st is None:
        return "shards starting (no shard has planned the job yet)"
    total = st["total_rows"]
    rows = (f"{st['rows_done']:,} / {total:,} rows ({st['rows_done'] / total:.1%})" if total else
            f"{st['rows_done']:,} rows")
    return f"{rows}, {details(st)}"
