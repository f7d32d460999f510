"""`LLMStage`, batchjob as a stage of a Ray Data pipeline (`ds.map_batches(LLMStage, ...)`): an LLM per actor,
the batches of its threads sharing the engine's steps. Ray is not imported here: Ray Data constructs and calls the
class."""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from batchjob.api import GENERATE_KEYWORDS, LLM
from batchjob.job.rows.chat_templates import check_chat_template
from batchjob.job.options.keywords import check_names
from batchjob.job.rows.prompt_records import PROMPT_KEYS, prompt_records
from batchjob.job.rows.row_server import RowServer

STAGE_COLUMNS = ("generated_text", "finish_reason", "prompt_tokens", "completion_tokens", "error", "error_code")


class LLMStage:
    """A stage for pipelines that already are a Ray Dataset (docs/guide/ray.md), one engine per actor; within a batch
    the engine batches continuously, batches come one after another per actor. Its failure semantics are Ray
    Data's (a failed batch is retried whole or fails the dataset), not batchjob's commits: for exactly-once jobs over
    files use `batchjob ray submit`. Ray is not imported here.

    `ds.map_batches(LLMStage, fn_constructor_kwargs={"model": ..., "max_tokens": 64}, concurrency=1,
    batch_size=256)`. A batch's rows name their prompt as a job's rows do: a `prompt` column (text or token ids),
    or `messages`; columns named like sampling parameters override the stage's per row. The batch comes back with
    batchjob's output columns added."""

    def __init__(self, model: str = "smollm2", engine: dict | None = None, **options: Any):
        """`engine`: LLM(...) keywords (dtype, kv_cache_gb, max_num_seqs, ...); `options`: generate()'s (sampling
        parameters, chat, chat_template, system_prompt). Batches given at once (Ray Data's `max_concurrency` in
        `ray_remote_args`) share the engine's steps (job/rows/row_server.py). The model loads at the first batch, on the
        thread that runs it: Ray Data calls a stage from a thread of its own, and OpenMP's workers are fast only for
        the one thread that makes them (libgomp throttles its workers' spinning once a second thread has a team of its
        own: the stage ran 1.6x slower when the model loaded on the actor's main thread; docs/benchmarks.md)."""
        check_names(options, GENERATE_KEYWORDS, "LLMStage()")
        self._args, self._engine_options, self._options = model, dict(engine or {}), options
        self._loaded: tuple[LLM, RowServer] | None = None  # at the first batch
        self._start = threading.Lock()

    @property
    def llm(self) -> LLM:
        return self._load()[0]

    @property
    def server(self) -> RowServer:
        return self._load()[1]

    def _load(self) -> tuple[LLM, RowServer]:
        with self._start:
            if self._loaded is None:
                llm = LLM(self._args, **self._engine_options)
                self._loaded = llm, llm.row_server(self._options)
            return self._loaded

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        names = list(batch)
        rows = [{k: _plain(v) for k, v in zip(names, values)} for values in zip(*(batch[k] for k in names))]
        # the prompt's fields go to the engine; every column comes back as it was
        records = prompt_records([{k: v for k, v in row.items() if k in PROMPT_KEYS and v is not None} for row in rows])
        llm, server = self._load()
        if any(isinstance(r, dict) and r.get("messages") is not None for r in records):
            check_chat_template(server.builder.chat_template or llm.tokenizer.chat_template)
        results = server.submit(records)
        out = {k: list(batch[k]) for k in names}
        for column, field in zip(STAGE_COLUMNS, ("text", "finish_reason", "prompt_tokens", "completion_tokens",
                                                  "error", "error_code")):
            out[column] = [getattr(r, field) for r in results]
        return out


def _plain(value):
    """A batch cell as the prompt builder reads a row's value: numpy scalars and arrays as Python values."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
