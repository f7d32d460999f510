"""A job's rows in memory, for the Python API (api.py): records (what `generate()`, `chat()`, `embed()` and
`score()` accept, job/rows/prompt_records.py) through the same prompt building, sampling and row loop as a job's rows
(job/rows/row_driver.py), one `Result` each, in input order."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from batchjob.engine.engine import Engine
from batchjob.engine.requests import Refusal, RequestOutput, invalid
from batchjob.job.options.config import JobConfig
from batchjob.job.options.modes import Task
from batchjob.job.rows.prompt_builder import PromptBuilder, RowError
from batchjob.job.rows.prompt_records import is_token_ids, prompt_records
from batchjob.job.rows.results import (EMBEDDING, LOGPROBS, REASONING, REASONING_TOKENS, TOOL_CALL_ERROR, TOOL_CALLS,
                                       Completion, OutputColumns, PendingRow, ResultRow)
from batchjob.job.rows.row_driver import RowDriver
from batchjob.job.rows.row_plan import plan_rows
from batchjob.reasoning.parsers import job_parser

ALL_COLUMNS = OutputColumns(logprobs=True, completions=True, prompt_logprobs=True)  # a Result has these (None when unused)
EMBED_COLUMNS = OutputColumns(embedding=True)


@dataclass(frozen=True, slots=True)
class Result:
    """One prompt's result: the fields of an output row (docs/guide/output-and-resume.md); `text` is `generated_text`."""
    text: str
    finish_reason: str  # stop | length | error
    prompt_tokens: int
    completion_tokens: int  # of all n completions
    error: str | None = None  # why the prompt failed (finish_reason "error")
    error_code: str | None = None  # and its kind (finish_reason "error"): context_length_exceeded or invalid_request
    logprobs: list[dict] | None = None  # the first completion's, when logprobs was asked for
    completions: tuple[Completion, ...] | None = None  # n > 1: all n, in order (the first is also `text`)
    token_ids: tuple[int, ...] = ()  # the first completion's generated token ids
    embedding: list[float] | None = None  # embed(): the prompt's pooled (and normalised) final hidden states
    # score(): each prompt token's logprob (None for the first) and their sum; with a continuation its summed
    # logprob, its token count and whether each of its tokens is the argmax; generate(prompt_logprobs=k): the
    # entries {token_id, token, logprob, top_logprobs} (None first)
    prompt_logprobs: list | None = None
    prompt_logprob_sum: float | None = None
    continuation_logprob: float | None = None
    continuation_tokens: int | None = None
    is_greedy: bool | None = None
    prompt_top_logprobs: list | None = None  # score(prompt_logprobs=k > 0): the top k per position (None first)
    reasoning: str | None = None  # with a reasoning parser: the first completion's thinking (`text` is its answer)
    reasoning_tokens: int | None = None
    tool_calls: list[dict] | None = None  # with a tool parser: the answer's calls (`text` is what is left of it)
    tool_call_error: str | None = None  # why the answer's call did not parse (`text` is then the raw answer)


RESULT_SCORE_FIELDS = ("prompt_logprobs", "prompt_logprob_sum", "continuation_logprob", "continuation_tokens",
                       "is_greedy", "prompt_top_logprobs")  # the output columns of the same names


def failed(error: str | Refusal, prompt_tokens: int = 0) -> Result:
    """A row that never ran: the engine's refusal (its code with it), or a row error (an invalid request)."""
    return to_result(ResultRow.failed(error if isinstance(error, Refusal) else invalid(error), prompt_tokens))


def result_of(row: PendingRow, outputs: list[RequestOutput]) -> Result:
    return to_result(row.result(), completions=tuple(row.done) if row.n > 1 else None, token_ids=outputs[0].output_ids)


def to_result(r: ResultRow, **more) -> Result:
    """The API's Result of a row's ResultRow (`more`: what only the API gives: the completions, the token ids)."""
    extra = r.extra
    return Result(text=r.generated_text, finish_reason=r.finish_reason, prompt_tokens=r.prompt_tokens,
                  completion_tokens=r.completion_tokens, error=None if r.error is None else r.error.message,
                  error_code=None if r.error is None else r.error.code.value, logprobs=extra.get(LOGPROBS),
                  embedding=extra.get(EMBEDDING), **more,
                  **{name: extra.get(name) for name in (*RESULT_SCORE_FIELDS, REASONING, REASONING_TOKENS, TOOL_CALLS,
                                                        TOOL_CALL_ERROR)})


def run_in_memory(engine: Engine, tokenizer, cfg: JobConfig, builder: PromptBuilder, records: list[dict | str]) -> list[Result]:
    """The job's row loop in memory: rows enter the engine with the read-ahead a job uses, their random streams
    from (seed, row), and leave through the same RowDriver as a job's rows. A record that is a string is not a
    prompt: the string says why."""
    results: list[Result | None] = [None] * len(records)
    run_rows(engine, tokenizer, cfg, builder, ((i, i, r) for i, r in enumerate(records)), results.__setitem__)
    return results  # every row has its Result once the engine is idle


def run_rows(engine: Engine, tokenizer, cfg: JobConfig, builder: PromptBuilder, rows: Iterator[tuple[Any, int, dict | str]],
             done: Callable[[Any, Result], None]) -> None:
    """The row loop over `rows` (key, row index for the random stream, record), read as the engine has room:
    `done(key, result)` for each, until the engine is idle and `rows` gives no more for now (an iterator may give
    more on a later call: job/rows/row_server.py feeds several callers' rows into one loop so)."""
    base = cfg.sampling_defaults()
    reasoning, _ = job_parser(cfg.reasoning_parser, tokenizer, builder.chat_template)
    tool_parser = None if builder.tool_rows is None else builder.tool_rows.parser
    driver: RowDriver = RowDriver(engine, tokenizer, truncate=cfg.truncate, reasoning=reasoning, tool_parser=tool_parser)
    columns = {Task.EMBED: EMBED_COLUMNS, Task.SCORE: OutputColumns(score=True, top_logprobs=bool(base.prompt_logprobs))
               }.get(cfg.task, OutputColumns(logprobs=True, completions=True, prompt_logprobs=True,
                                             reasoning=reasoning is not None, tools=tool_parser is not None))

    def refill() -> None:
        batch = []  # (key, row index, record): read as the engine has room, planned together (job/rows/row_plan.py)
        while engine.num_waiting() + len(batch) < cfg.read_ahead_rows and (item := next(rows, None)) is not None:
            key, index, record = item
            if isinstance(record, str):
                done(key, failed(record))
            else:
                batch.append(item)
        plans = plan_rows(builder, [r for _, _, r in batch], [base] * len(batch), columns, reasoning, cfg.task)
        for (key, index, _), plan in zip(batch, plans):
            if isinstance(plan, RowError):
                done(key, failed(str(plan)))
            elif err := driver.add(key, plan, columns, seed=cfg.seed, row_index=index):
                done(key, failed(err, prompt_tokens=sum(map(len, plan.prompts))))

    for step in driver.steps(refill):
        for row in step.rows:
            done(row.key, result_of(row.row, row.outputs))


def score_records(prompts: Any, continuations: Any) -> list[dict | str]:
    """score()'s prompts (a string or token ids, or a list of them) and optional continuations, one per
    prompt, as the input records of a score job."""
    records = prompt_records(prompts)
    if continuations is None:
        return records
    if isinstance(continuations, str) or is_token_ids(continuations):
        continuations = [continuations]
    if not isinstance(continuations, (list, tuple)) or len(continuations) != len(records):
        raise ValueError(f"continuations: expected one per prompt ({len(records)}), got "
                         f"{len(continuations) if isinstance(continuations, (list, tuple)) else type(continuations).__name__}")
    return [{**r, "continuation": c} if isinstance(r, dict) else r for r, c in zip(records, continuations)]
