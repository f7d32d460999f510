"""Rows through the engine: read ahead from each stream, tokenized in batches, n engine requests per row; the
finished requests assembled back into result rows, written to their stream's sink and counted.

A batch is read and planned (tokenized, its images fetched, decoded and preprocessed into pixel values) on a thread
of its own while the engine steps (vLLM keeps its input processing out of the engine loop the same way): the loop
only adds the planned rows. It waits for a batch only when the engine has nothing else to do."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from batchjob.engine.engine import Engine
from batchjob.engine.requests import invalid
from batchjob.job.options.config import JobConfig
from batchjob.job.engine_setup import adapter_slots, lanes_of
from batchjob.job.error_budget import ErrorBudget
from batchjob.job.rows.images import ImageRows
from batchjob.job.rows.prompt_builder import PromptBuilder, RowError
from batchjob.job.rows.results import ResultRow
from batchjob.job.rows.tool_rows import ToolRows
from batchjob.job.rows.row_driver import RowDriver, StepDone
from batchjob.job.rows.row_plan import RowPlan, plan_rows
from batchjob.models.loader import LoadedModel
from batchjob.job.streams import Stream
from batchjob.job.report.summary import JobSummary

FEED_BATCH = 256  # rows read and tokenized together


@dataclass(slots=True)
class PlannedBatch:
    """A batch of a stream's rows, read and planned off the engine loop: the rows to add (row index, kept columns,
    lane, where the source says it is, its plan or the RowError that fails it), the rows failed at reading, and
    whether the stream ended."""
    rows: list[tuple[int, dict, str, str | None, RowPlan | RowError]] = field(default_factory=list)
    failed: list[tuple[int, dict, ResultRow]] = field(default_factory=list)
    exhausted: bool = False

    def __len__(self) -> int:
        return len(self.rows) + len(self.failed)


class RowFeed:
    """The rows between the streams and their sinks. `use_messages`: whether each source (by id) has
    the messages column; `lane_column_out`: rows pick their lane, so each result row records it."""

    def __init__(self, cfg: JobConfig, loaded: LoadedModel, engine: Engine, use_messages: dict[int, bool],
                 template: str | None, lane_column_out: bool, summary: JobSummary, images: ImageRows | None = None,
                 image_bases: dict[int, Path] | None = None, reasoning=None, tool_rows: ToolRows | None = None):
        """`images`: a vision-language model's image facts (None: text only); `image_bases`: per source (by id),
        the folder a relative image path starts from (its input file's)."""
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = loaded.tokenizer
        self.builders = {key: PromptBuilder(cfg, loaded.tokenizer, uses, template, images=images,
                                            image_base=(image_bases or {}).get(key), model_name=loaded.name,
                                            tool_rows=tool_rows,
                                            adapters=adapter_slots(cfg))
                         for key, uses in use_messages.items()}
        self.lane_column_out = lane_column_out
        self.summary = summary
        self.lanes = {lane.name: lane for lane in lanes_of(cfg)}
        self.params = {lane["name"]: cfg.sampling_defaults(lane.get("max_tokens")) for lane in cfg.lanes}
        self.default_params = cfg.sampling_defaults()
        # rows in the engine, known by (stream, row index, kept columns), and the loop that runs them
        self.driver: RowDriver[tuple[Stream, int, dict]] = RowDriver(
            engine, loaded.tokenizer, truncate=cfg.truncate, reasoning=reasoning,
            tool_parser=None if tool_rows is None else tool_rows.parser)
        self.dropped = 0  # rows read but put back by a stop
        self.draining = False  # stopping: no more rows are read, the running ones finish
        self.one_token_stops = (0, 0)  # (rows finished without error, of those: ended at their first token)
        self.first_error: str | None = None
        self.before = (0, 0)  # (rows, errors) committed by earlier runs: set when the run starts
        self.budget: ErrorBudget | None = None  # max_errors, set when the run starts
        # the planning thread, and each stream's batch being read and planned on it (by the stream's id)
        self.planner = ThreadPoolExecutor(1, thread_name_prefix="batchjob-plan")
        self.planning: dict[int, Future[PlannedBatch]] = {}

    # rows in

    def lane_for(self, stream: Stream, record: dict) -> str:
        if stream.lane is not None:
            return stream.lane
        if not self.cfg.lanes:
            return "default"
        name = record.get(self.cfg.lane_column)
        if name is not None:
            if name not in self.lanes:
                raise RowError(f"column {self.cfg.lane_column!r}: unknown lane {name!r}; lanes: {', '.join(self.lanes)}")
            return name
        prio = record.get("priority")
        if prio is None:
            return next(iter(self.lanes))  # rows that name no lane go to the first declared lane
        match = [lane.name for lane in self.lanes.values() if lane.priority == prio]
        if not match:
            raise RowError(f"column 'priority': no lane has priority {prio!r}; lanes: "
                           + ", ".join(f"{lane.name}={lane.priority}" for lane in self.lanes.values()))
        return match[0]

    def refill(self, streams: list[Stream], budget: int, stopping: bool) -> None:
        """Before each step (RowDriver.steps): each stream's rows up to `budget` waiting; once `stopping`, the
        rows that have not started go back to the input, and none are read after."""
        if stopping and not self.draining:
            self.draining = True
            self.drop_waiting()
            for stream in streams:  # a batch being planned never enters the engine: its rows run again on resume
                pending = self.planning.pop(id(stream), None)
                batch = pending.result() if pending is not None else None
                if batch is not None:
                    self.dropped += len(batch)
                    stream.exhausted = stream.exhausted or (batch.exhausted and not len(batch))
        if not self.draining:
            for stream in streams:
                self.feed(stream, budget)

    def feed(self, stream: Stream, budget: int) -> None:
        """Queue rows until `budget` rows wait in the engine: the batch planned since the last step is added, the
        next one is read and planned on the planning thread while the engine steps. With nothing in the engine,
        the loop waits for the batch (bad rows become error rows as their batch is added)."""
        lane = stream.lane or None  # a stream of one lane counts that lane's queue, else every lane's
        while True:
            pending = self.planning.get(id(stream))
            if pending is not None:
                if not pending.done() and self.engine.has_work:
                    return  # still planning: the engine steps meanwhile
                del self.planning[id(stream)]
                self._add(stream, pending.result())
                continue
            room = budget - self.engine.num_waiting(lane)
            if stream.exhausted or room <= 0:
                return
            self.planning[id(stream)] = self.planner.submit(self._plan, stream, min(room, FEED_BATCH))
            if self.engine.has_work:
                return

    def _plan(self, stream: Stream, count: int) -> PlannedBatch:
        """On the planning thread: up to `count` rows read from the stream and planned (tokenized in one call,
        images fetched and preprocessed); nothing here writes a sink or touches the engine."""
        batch = PlannedBatch()
        read = []  # (row index, record, kept columns, lane, where the source says the row is)
        for _ in range(count):
            item = next(stream.rows, None)
            if item is None:
                batch.exhausted = True
                break
            record = item.record or {}
            kept = {c: record.get(c) for c in stream.columns.keep}
            if item.error:
                batch.failed.append((item.row_index, kept, ResultRow.failed(invalid(item.error))))
                continue
            try:
                row_lane = self.lane_for(stream, record)
            except RowError as e:
                batch.failed.append((item.row_index, kept, ResultRow.failed(invalid(str(e)))))
                continue
            if self.lane_column_out:
                kept["lane"] = row_lane
            read.append((item.row_index, record, kept, row_lane, item.where))
        defaults = [self.params.get(r[3], self.default_params) for r in read]
        plans = plan_rows(self.builders[id(stream.source)], [r[1] for r in read], defaults, stream.columns,
                          self.driver.reasoning, self.cfg.task)
        batch.rows = [(row_index, kept, row_lane, where, plan)
                      for (row_index, _, kept, row_lane, where), plan in zip(read, plans)]
        return batch

    def _add(self, stream: Stream, batch: PlannedBatch) -> None:
        """A planned batch into the engine, on the loop's thread: each row's n requests, or its error row."""
        for row_index, kept, result in batch.failed:
            self.emit(stream, row_index, kept, result)
        for row_index, kept, row_lane, where, plan in batch.rows:
            err = invalid(str(plan)) if isinstance(plan, RowError) else self.driver.add(
                (stream, row_index, kept), plan, stream.columns, seed=self.cfg.seed ^ stream.key_salt,
                row_index=row_index, lane=row_lane)
            if err:  # `where`: the row's place as its source names it
                tokens = 0 if isinstance(plan, RowError) else sum(map(len, plan.prompts))  # a prompt too long
                self.emit(stream, row_index, kept, ResultRow.failed(err.within(where) if where else err, tokens))
        stream.exhausted = stream.exhausted or batch.exhausted

    def close(self) -> None:
        """The planning thread ends; a batch it was planning is left unread by the engine (a stop's rows: they run
        again on resume)."""
        for pending in self.planning.values():
            pending.cancel()
        self.planning.clear()
        self.planner.shutdown(wait=True, cancel_futures=True)

    @property
    def rows_in_flight(self) -> int:
        """Rows in the engine (a row with n > 1 completions counts once)."""
        return self.driver.num_rows

    def drop_waiting(self) -> None:
        """Stopping: rows that have not started go back to the input (rerun on resume)."""
        self.dropped += self.driver.drop_waiting()

    # rows out

    def finished(self, step: StepDone) -> None:
        """A step's finished rows (each once its last completion is in) to their sinks."""
        for done in step.rows:
            stream, row_index, kept = done.key
            self.emit(stream, row_index, kept, done.row.result())

    def emit(self, stream: Stream, row_index: int, kept: dict, result: ResultRow) -> None:
        """One output row to its stream's sink, counted in the summary."""
        stream.sink.write(result.columns(row_index, kept))
        s, reason = self.summary, result.finish_reason
        s.rows += 1
        s.errors += reason == "error"
        s.prompt_tokens += 0 if reason == "error" else result.prompt_tokens  # a row refused (too long) computed none
        s.generated_tokens += result.completion_tokens
        if reason == "error":
            self.first_error = self.first_error or f"row {row_index}: {result.error}"
            self.check_errors()
        else:
            ok, first = self.one_token_stops
            self.one_token_stops = (ok + 1, first + (reason == "stop" and result.completion_tokens <= 1))

    def check_errors(self, final: bool = False) -> None:
        """max_errors, over this run's rows and those committed before it."""
        rows, errors = self.before
        self.budget.check(errors + self.summary.errors, rows + self.summary.rows, final)
