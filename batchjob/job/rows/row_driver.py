"""The one row loop that drives the engine, for the job (RowFeed) and the Python API (api.py) alike: a row enters
as its n EngineRequests (one per completion, each with its own random stream; engine/requests.py), the engine
steps while it has work, and a row leaves once its last request finishes, as one PendingRow with all n. The
caller says how rows come in (`refill`, called before each step) and what becomes of finished ones."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from batchjob.engine.engine import Engine
from batchjob.engine.requests import EngineRequest, Refusal, RequestOutput
from batchjob.job.rows.results import OutputColumns, PendingRow, TokenText
from batchjob.job.rows.row_plan import RowPlan

Key = TypeVar("Key")  # what the caller knows a row by (its stream and index, or its place in a list)


@dataclass(slots=True)
class DoneRow(Generic[Key]):
    key: Key
    row: PendingRow
    outputs: list[RequestOutput]  # its n completions, in order


@dataclass(slots=True)
class StepDone(Generic[Key]):
    """What one engine step finished: its requests (for the job's statistics) and the rows they completed."""
    outputs: list[RequestOutput]
    rows: list[DoneRow[Key]]


class RowDriver(Generic[Key]):
    def __init__(self, engine: Engine, tokenizer, truncate: bool = False, reasoning=None, tool_parser: str | None = None):
        """`reasoning`: the reasoning parser that splits each completion's thinking (reasoning/parsers.py), or None;
        `tool_parser`: the tool parser that reads the calls of rows with tools (tool_calls/parsers.py), or None."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.reasoning = reasoning
        self.tool_parser = tool_parser
        self.truncate = truncate  # embed rows: a prompt past the context keeps its first max_model_len tokens
        self.token_text = TokenText(tokenizer)
        self._by_id: dict[int, tuple[Key, PendingRow, list[RequestOutput | None], int]] = {}  # request id -> (key, row, outputs, c)
        self.num_rows = 0  # rows in the engine (a row of n completions counts once)

    def add(self, key: Key, plan: RowPlan, columns: OutputColumns, *, seed: int, row_index: int,
            lane: str = "default") -> Refusal | None:
        """Queue a planned row's n requests (job/rows/row_plan.py); their random streams come from (seed, row_index,
        completion). Returns why (and queues nothing) when a prompt can never run."""
        prompts, params = plan.prompts, plan.params
        many = len(prompts) > 1
        inputs = list(prompts) if many else list(prompts) * params.n
        assert not many or params.n == 1, "a row of several prompts has one completion per prompt"
        if self.truncate and params.pooling is not None:
            inputs = [ids[:self.engine.max_model_len] for ids in inputs]
        row = PendingRow(len(inputs), columns, continuation_start=plan.continuation_start, several_prompts=many,
                         tools=plan.tools)
        requests = [EngineRequest(ids, params, seed, row_index, c, lane, plan.images, plan.lora)
                    for c, ids in enumerate(inputs)]
        for c, request in enumerate(requests if many else ()):
            err = self.engine.never_fits(request)
            if err:  # one input that can never run fails the row: none of its inputs enter the engine
                return err.within(f"input[{c}]")
        outputs: list[RequestOutput | None] = [None] * len(requests)  # each completion's, as it finishes
        for c, request in enumerate(requests):
            got = self.engine.submit(request)
            if isinstance(got, Refusal):  # the prompt never fits: the same for every completion (only the first is tried)
                return got
            self._by_id[got] = (key, row, outputs, c)
        self.num_rows += 1
        return None

    def steps(self, refill: Callable[[], None], proceed: Callable[[], bool] = lambda: True) -> Iterator[StepDone[Key]]:
        """The row loop: `refill()` (queue rows up to the caller's read-ahead), then one engine step, while the
        engine has work and `proceed()` (a stopping job's drain time is not over); yields each step's finished
        requests and rows."""
        while True:
            refill()
            if not self.engine.has_work or not proceed():
                return
            outputs = self.engine.run_step()
            yield StepDone(outputs, [done for output in outputs if (done := self.finished(output)) is not None])

    def finished(self, output: RequestOutput) -> DoneRow[Key] | None:
        """Record a finished request; the row once its last completion is in."""
        key, row, outputs, c = self._by_id.pop(output.request_id)
        outputs[c] = output
        if not row.add(c, output, self.tokenizer, self.token_text, self.reasoning, self.tool_parser):
            return None
        self.num_rows -= 1
        return DoneRow(key, row, outputs)

    def drop_waiting(self) -> int:
        """Stopping: the rows whose requests never started leave the engine; returns how many requests."""
        rows, dropped = set(), 0
        for request_id in self.engine.drop_waiting_requests():
            entry = self._by_id.pop(request_id, None)
            if entry is not None:
                rows.add(id(entry[1]))
            dropped += 1
        self.num_rows -= len(rows)
        return dropped
