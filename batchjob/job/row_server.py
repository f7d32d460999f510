"""Several callers' rows through one engine at once: each `submit` (from any thread) hands its records to a loop
thread that owns the engine and feeds every caller's rows into the same row loop (job/in_memory.py run_rows), so a
batch that arrives while another runs joins its steps (continuous batching across batches, as Ray Data LLM's
`max_concurrency`); the call returns its own Results, in order. A row's random stream comes from its index in its
own batch, so a batch's text does not depend on what shared its steps."""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from batchjob.engine.engine import Engine
from batchjob.job.config import JobConfig
from batchjob.job.in_memory import Result, run_rows
from batchjob.job.prompt_builder import PromptBuilder


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
        """`engine`: gives the engine (built on first use, on the loop thread); `reset`: after a failed loop (rows
        may be left in the engine), start clean."""
        self.engine, self.tokenizer, self.cfg, self.builder, self.reset = engine, tokenizer, cfg, builder, reset
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def submit(self, records: list) -> list[Result]:
        """Each record's Result, in order, once all of them are done (blocks; safe from several threads)."""
        batch = _Batch(records)
        with self._start:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="batchjob-rows", daemon=True)
                self._thread.start()
        self.inbox.put(batch)
        batch.finished.wait()
        if batch.error is not None:
            raise batch.error
        return batch.results

    def _serve(self) -> None:
        while True:
            active: list[_Batch] = []
            try:
                run_rows(self.engine(), self.tokenizer, self.cfg, self.builder,
                         _Arrivals(self.inbox, self.inbox.get(), active), self._done)
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
