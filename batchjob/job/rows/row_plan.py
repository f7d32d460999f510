"""The one place that turns input records into engine rows: each record's prompt ids (an OpenAI embeddings line:
one per input), its images fetched (a batch's together) and expanded into their placeholders, a score row's
continuation, its sampling parameters (the row's own over the job's or its lane's, checked against the output's
columns; its bad_words tokenized), its thinking budget and tool grammar, its tools and its LoRA slot; or the
RowError that fails it. The job's feed (job/feed.py) and the Python API's loop (job/rows/in_memory.py) both plan their
rows here, then hand each plan to the RowDriver (job/rows/row_driver.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from batchjob.engine.requests import SamplingParams
from batchjob.images.sources import fetch_many
from batchjob.job.options.modes import Task
from batchjob.job.rows.prompt_builder import PromptBuilder, RowError, RowReading, budgeted, row_sampling
from batchjob.job.rows.results import OutputColumns
from batchjob.tool_calls.requests import ToolRequest


@dataclass(frozen=True, slots=True)
class RowPlan:
    """A row as the engine takes it: the RowDriver queues its n requests."""
    prompts: list[list[int]]  # its prompt's ids (one list), or an OpenAI embeddings line's inputs (one each)
    params: SamplingParams
    continuation_start: int | None = None  # a score row's continuation: its first token's position
    images: tuple = ()  # the prompt's ImageSlots
    tools: ToolRequest | None = None
    lora: int = -1  # its adapter's slot (-1: the base model)


def plan_rows(builder: PromptBuilder, records: list[dict], defaults: list[SamplingParams], columns: OutputColumns,
              reasoning, task: Task) -> list[RowPlan | RowError]:
    """One plan (or the RowError that fails the row) per record, in order; `defaults`: each row's sampling defaults
    (the job's, or its lane's); `reasoning`: the job's reasoning parser (a thinking budget's end of thinking). The
    records' texts are tokenized in one call and their http(s) images fetched together, several at a time."""
    readings = [_read(builder, r) for r in records]  # each record's messages and tools, walked once
    all_prompts = builder.prompts_many(records, readings)
    fetched = (fetch_many(u for r, g in zip(records, readings) if not isinstance(g, RowError) for u in builder.image_urls(r, g))
               if builder.images is not None else None)
    starts: list = [None] * len(records)
    if task == Task.SCORE:
        starts = builder.continuation_starts(records, [p if isinstance(p, RowError) else p[0] for p in all_prompts])
    plans: list[RowPlan | RowError] = []
    for record, reading, ids, start, base in zip(records, readings, all_prompts, starts, defaults):
        try:
            plans.append(_plan(builder, record, reading, ids, start, base, columns, reasoning, fetched))
        except RowError as e:
            plans.append(e)
    return plans


def _read(builder: PromptBuilder, record: dict) -> RowReading | RowError:
    try:
        return builder.read(record)
    except RowError as e:
        return e


def _plan(builder: PromptBuilder, record: dict, reading: RowReading | RowError, ids, start, base: SamplingParams,
          columns: OutputColumns, reasoning, fetched) -> RowPlan:
    for problem in (ids, start, reading):  # ids carry the reading's error unless the endpoint is wrong
        if isinstance(problem, RowError):
            raise problem
    params = row_sampling(record, base, in_memory=builder.in_memory)
    if params.bad_words:
        params = dataclasses.replace(params,
                                     bad_words_token_ids=bad_words_token_ids(builder.tokenizer, params.bad_words))
    columns.check(params)
    images = ()
    if builder.images is not None:
        expanded, images = builder.with_images(record, reading, ids[0], fetched)
        ids = [expanded]
    params = budgeted(params, reasoning, ids[0])
    tools = reading.tools
    return RowPlan(ids, builder.constrained(params, tools), start, images, tools, builder.lora_slot(record))


def bad_words_token_ids(tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad_words: each word (its leading space stripped) alone, and after a space where that
    makes another first token but as many tokens (the word in the middle of a text)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(alone)
        if alone and spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return tuple(s for s in sequences if s)
