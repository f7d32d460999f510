"""Several callers' rows through one engine at once: each `submit` (from any thread) queues its records; one caller
at a time runs the row loop (job/rows/in_memory.py run_rows) over every caller's rows, so a batch that arrives while
another runs joins its steps (continuous batching across batches, as Ray Data LLM's `max_concurrency`); each call
returns its own Results, in order. A row's random stream comes from its index in its
own batch, so a batch's text does not depend on what shared its steps."""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from batchjob.engine.engine import Engine
from batchjob.job.options.config import JobConfig
from batchjob.job.rows.in_memory import Result, run_rows
from batchjob.job.rows.prompt_builder import PromptBuilder


class _Batch:
    def __init__(self, records: list) -> None:
        self.records, self.results = records, [None] * len(records)
        self.remaining, self.finished, self.error = len(records), threading.Event(), None
        if not records:
            self.finished.set()


class _Arrivals:
    """The rows of the batches queued so far, one at a time; StopIteration while none are waiting (the loop asks
    again before each step, and later arrivals join)."""

    def __init__(self, inbox: queue.SimpleQueue, first: _Batch, active: list[_Batch]) -> None:
        self.inbox, self.active = inbox, active
        self.rows = self._rows(first)

    def _rows(self, batch: _Batch):
        self.active.append(batch)
        return (((batch, i), i, r) for i, r in enumerate(batch.records))

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            row = next(self.rows, None)
            if row is not None:
                return row
            try:
                self.rows = self._rows(self.inbox.get_nowait())
            except queue.Empty:
                raise StopIteration from None


class RowServer:
    def __init__(self, engine: Callable[[], Engine], tokenizer, cfg: JobConfig, builder: PromptBuilder,
                 reset: Callable[[], None] = lambda: None):
        """`engine`: gives the engine (built on first use); `reset`: after a failed loop (rows may be left in the
        engine), start clean."""
        self.engine, self.tokenizer, self.cfg, self.builder, self.reset = engine, tokenizer, cfg, builder, reset
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._serving = threading.Lock()

    def submit(self, records: list) -> list[Result]:
        """Each record's Result, in order, once all of them are done (blocks; safe from several threads). The calling
        thread runs the row loop itself when no other caller is running it (then every caller's rows go through it
        until none are left), so a lone caller computes on its own thread: OpenMP's workers serve the thread that
        made them, and a loop on a thread of its own ran 1.7x slower than on the caller's (Ray Data's stage, 2 cores:
        docs/benchmarks.md)."""
        batch = _Batch(records)
        self.inbox.put(batch)
        while not batch.finished.is_set():
            if self._serving.acquire(blocking=False):
                try:
                    self._serve()
                finally:
                    self._serving.release()
            else:  # another caller runs the loop and will take these rows; wake to take over if it is done
                batch.finished.wait(timeout=0.05)
        if batch.error is not None:
            raise batch.error
        return batch.results

    def _serve(self) -> None:
        """The row loop over every batch queued, until none is waiting and the engine is idle."""
        while True:
            try:
                first = self.inbox.get_nowait()
            except queue.Empty:
                return
            active: list[_Batch] = []
            arrivals = _Arrivals(self.inbox, first, active)  # `first` is active before anything can fail
            try:
                run_rows(self.engine(), self.tokenizer, self.cfg, self.builder, arrivals, self._done)
            except BaseException as e:  # noqa: BLE001 - every waiting caller gets the error; the loop goes on
                self.reset()
                for batch in active:
                    if not batch.finished.is_set():
                        batch.error = e
                        batch.finished.set()

    @staticmethod
    def _done(key, result: Result) -> None:
        batch, index = key
        batch.results[index] = result
        batch.remaining -= 1
        if batch.remaining == 0:
            batch.finished.set()
