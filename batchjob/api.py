"""The Python API: `generate()` runs prompts in memory and `run()` runs a job, with the engine, sampling and
chat handling of `batchjob run`. An `LLM` holds one loaded model and its engine; `generate()` keeps the
last few in a cache keyed by model and engine knobs, so a notebook does not reload a model per call."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchjob.job.config import FIELDS, SECTIONS, ConfigError, JobConfig, load_job
from batchjob.device import choose_device, choose_dtype
from batchjob.engine.core.sequence import Sequence
from batchjob.engine.engine import Engine
from batchjob.job.run import run_job
from batchjob.job.engine_setup import build_engine
from batchjob.models.loader import load_model, resolve_model_path
from batchjob.job.prompt_records import prompt_records
from batchjob.job.prompt_builder import PromptBuilder, RowError, row_sampling
from batchjob.job.results import Completion, OutputColumns, PendingRow
from batchjob.job.rows_in_flight import RowsInFlight
from batchjob.job.summary import JobSummary

# generate()'s keywords, named as in a job file (and vLLM); `seed` is the job seed: row i's random stream
# comes from (seed, i), as row i of `batchjob run` (a prompt dict's own `seed` is that row's, as in a job)
SAMPLING_OPTIONS = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "stop", "stop_token_ids", "include_stop_str_in_output",
                    "ignore_eos", "logprobs", "n", "seed")
CHAT_OPTIONS = ("chat", "chat_template", "system_prompt")
ENGINE_OPTIONS = ("dtype", "device", "kernels", "scheduling", "batch_size", "max_num_seqs", "max_num_batched_tokens",
                  "prefill_chunk", "block_size", "kv_cache_gb", "gpu_memory_utilization", "cuda_graphs", "kv_cache_dtype", "async_scheduling", "speculative", "num_speculative_tokens", "speculative_max_rows", "draft_model", "admission", "preemption", "swap_space_gb", "max_wait",
                  "prefix_caching", "read_ahead", "threads")
assert set(SAMPLING_OPTIONS + CHAT_OPTIONS + ENGINE_OPTIONS) <= set(FIELDS)

IN_MEMORY = "<in memory>"  # JobConfig's input and output, which an in-memory run has none of
CACHE_SIZE = 2  # loaded engines generate() keeps (each holds its weights and its KV cache)
ALL_COLUMNS = OutputColumns(logprobs=True, completions=True)  # a Result always has both fields (None when unused)


@dataclass(frozen=True, slots=True)
class Result:
    """One prompt's result: the fields of an output row (docs/guide/output-and-resume.md); `text` is `generated_text`."""
    text: str
    finish_reason: str  # stop | length | error
    prompt_tokens: int
    completion_tokens: int  # of all n completions
    error: str | None = None  # why the prompt failed (finish_reason "error")
    logprobs: list[dict] | None = None  # the first completion's, when logprobs was asked for
    completions: tuple[Completion, ...] | None = None  # n > 1: all n, in order (the first is also `text`)
    token_ids: tuple[int, ...] = ()  # the first completion's generated token ids


def failed(error: str, prompt_tokens: int = 0) -> Result:
    return Result(text="", finish_reason="error", prompt_tokens=prompt_tokens, completion_tokens=0, error=error)


class LLM:
    """A model loaded once, with its engine: `LLM(model="smollm2", dtype=..., max_num_seqs=...)`, then
    `.generate(prompts, temperature=..., ...)` as often as needed. Calls are serialized (one engine)."""

    def __init__(self, model: str = "smollm2", **engine: Any):
        _check_names(engine, ENGINE_OPTIONS, "LLM()")
        self.options = {k: v for k, v in engine.items() if v is not None}
        self.config = job_config({"model": model, **self.options})
        self.device = choose_device(self.config.device)
        self.dtype = choose_dtype(self.config.dtype, self.device)
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        self.loaded = load_model(model, dtype=self.dtype)
        self.tokenizer = self.loaded.tokenizer
        self._engine: Engine | None = build_engine(self.config, self.loaded, self.device, self.dtype)
        self._lock = threading.Lock()

    @property
    def kernels(self) -> str:
        return self.engine.model.kernels.name

    @property
    def engine(self) -> Engine:
        if self._engine is None:  # the last call stopped midway (Ctrl-C): its rows are still in the old engine
            self._engine = build_engine(self.config, self.loaded, self.device, self.dtype)
        return self._engine

    def generate(self, prompts: Any, **options: Any) -> list[Result]:
        """One Result per prompt, in input order. `options`: sampling parameters and chat, chat_template,
        system_prompt. A bad keyword or value raises ValueError; a bad prompt is a Result with an error."""
        _check_names(options, SAMPLING_OPTIONS + CHAT_OPTIONS, "generate()")
        template = chat_template_text(options.pop("chat_template", None))
        if isinstance(options.get("stop"), str):  # one stop string, never the job flag's JSON list text
            options["stop"] = [options["stop"]]
        system_prompt = options.get("system_prompt")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(f"system_prompt: expected a string, got {system_prompt!r}")
        cfg = job_config({"model": self.config.model, **self.options, **options})
        records = prompt_records(prompts)
        if cfg.chat or any(isinstance(r, dict) and r.get("messages") is not None for r in records):
            check_template(template or self.tokenizer.chat_template)
        builder = PromptBuilder(cfg, self.tokenizer, use_messages=True, chat_template=template)
        with self._lock:
            try:
                return self._generate(cfg, builder, records)
            except BaseException:  # e.g. Ctrl-C in a notebook: rows are left in the engine; start clean next time
                self._engine = None
                raise

    def _generate(self, cfg: JobConfig, builder: PromptBuilder, records: list[dict | str]) -> list[Result]:
        """The job's loop in memory: rows enter the engine with the read-ahead a job uses, their random streams
        from (seed, row), and leave through the same RowsInFlight as a job's rows."""
        engine = self.engine
        base = cfg.sampling_defaults()
        results: list[Result | None] = [None] * len(records)
        rows: RowsInFlight[int] = RowsInFlight(engine, self.tokenizer)
        read_ahead = cfg.read_ahead or 2 * cfg.max_num_seqs
        todo = iter(enumerate(records))
        exhausted = False
        while True:
            while not exhausted and engine.num_waiting() < read_ahead:
                item = next(todo, None)
                if item is None:
                    exhausted = True
                    break
                index, record = item
                if isinstance(record, str):  # not a prompt at all
                    results[index] = failed(record)
                    continue
                try:
                    ids = builder.token_ids(record)
                    params = row_sampling(record, base)
                except RowError as e:
                    results[index] = failed(str(e))
                    continue
                err = rows.add(index, ids, params, ALL_COLUMNS, seed=cfg.seed, row_index=index)
                if err:
                    results[index] = failed(err, prompt_tokens=len(ids))
            if not engine.has_work:
                break
            for seq in engine.step():
                done = rows.finished(seq)
                if done is not None:
                    results[done.key] = result_of(done.row, done.seqs)
        return results  # every row has its Result once the engine is idle


def result_of(row: PendingRow, seqs: list[Sequence]) -> Result:
    fields = row.fields()
    return Result(text=fields["text"], finish_reason=fields["reason"], prompt_tokens=fields["prompt_tokens"],
                  completion_tokens=fields["completion_tokens"], logprobs=fields["extra"].get("logprobs"),
                  completions=tuple(row.done) if row.n > 1 else None, token_ids=tuple(seqs[0].output_ids))


# the cache behind generate()

_cache: OrderedDict[tuple, LLM] = OrderedDict()
_cache_lock = threading.Lock()


def cached_llm(model: str = "smollm2", **engine: Any) -> LLM:
    """The cached LLM for this model and these engine knobs, loaded on first use; the least recently used
    one goes when more than CACHE_SIZE are held. `threads` is process-wide, so it is set, not keyed."""
    _check_names(engine, ENGINE_OPTIONS, "generate()")
    threads = engine.pop("threads", None)
    cfg = job_config({"model": model, "threads": threads, **engine})
    device = choose_device(cfg.device)
    key = (str(resolve_model_path(model)), device, str(choose_dtype(cfg.dtype, device)),
           *((name, getattr(cfg, name)) for name in ENGINE_OPTIONS if name not in ("dtype", "device", "threads")))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    with _cache_lock:
        llm = _cache.get(key)
        if llm is None:
            llm = _cache[key] = LLM(model, **engine)
            while len(_cache) > CACHE_SIZE:
                _cache.popitem(last=False)
        _cache.move_to_end(key)
        return llm


def clear_cache() -> None:
    """Drop the cached engines (e.g. to free their memory, or after changing a model's files in place)."""
    with _cache_lock:
        _cache.clear()


def generate(prompts: Any, *, model: str = "smollm2", **options: Any) -> list[Result]:
    """Run `prompts` in memory: a string, a list of token ids, a chat conversation (a list of {role,
    content}) or a dict of those fields plus per-prompt sampling parameters (a job's input row), or a list
    of any of these. Returns one Result per prompt, in order. `options`: the job file's sampling, chat
    and engine fields (docs/guide/python-api.md); the engine for (model, engine fields) is loaded once and cached."""
    _check_names(options, SAMPLING_OPTIONS + CHAT_OPTIONS + ENGINE_OPTIONS, "generate()")
    engine = {k: v for k, v in options.items() if k in ENGINE_OPTIONS}
    call = {k: v for k, v in options.items() if k not in ENGINE_OPTIONS}
    return cached_llm(model, **engine).generate(prompts, **call)


def run(job: str | Path | Mapping[str, Any], *, restart: bool = False, **overrides: Any) -> JobSummary:
    """Run a job as `batchjob run` does: `job` is a TOML job file or a dict of the same fields (with
    optional sampling/engine/output/job tables); `overrides` are job fields that win over it. Returns the
    summary; failures raise the project's errors (ConfigError, SourceError, ModelLoadError, ...)."""
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise ConfigError(f"run(): unknown field {unknown[0]!r}; known fields: {', '.join(sorted(FIELDS))}")
    if isinstance(job, Mapping):
        cfg = load_job(None, {**job_fields(job), **overrides})
    elif isinstance(job, (str, Path)):
        cfg = load_job(job, overrides)
    else:
        raise ConfigError(f"run(): job: expected a job file path or a dict of job fields, got {type(job).__name__}")
    return run_job(cfg, restart=restart)


# arguments

def job_config(values: dict) -> JobConfig:
    """The job file's validation for in-memory values (ConfigError, a ValueError, names the field)."""
    return load_job(None, {"input": IN_MEMORY, "output": IN_MEMORY, **values})


def job_fields(job: Mapping[str, Any]) -> dict:
    """A dict job, flattened as load_job flattens a job file's tables."""
    values = {}
    for key, value in job.items():
        table = key in SECTIONS and isinstance(value, Mapping)
        for name, v in (value.items() if table else [(key, value)]):
            if name not in FIELDS:
                shown = f"{key}.{name}" if table else name
                raise ConfigError(f"run(): unknown field {shown!r}; known fields: {', '.join(sorted(FIELDS))}")
            values[name] = v
    return values


def _check_names(given: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown keyword argument to {where}; known: {', '.join(allowed)}")


def chat_template_text(value: str | None) -> str | None:
    """A template file, as a job's chat_template, or (as vLLM also takes) the Jinja text itself."""
    if value is None:
        return None
    if not isinstance(value, (str, Path)):
        raise ValueError(f"chat_template: expected a file path or the template text, got {value!r}")
    if isinstance(value, str) and "{" in value:  # Jinja needs {{ or {%; a path rarely has a brace
        return value
    try:
        return Path(value).read_text()
    except OSError as e:
        raise ValueError(f"chat_template: cannot read {value}: {e.strerror or e}") from None


def check_template(template: str | None) -> None:
    from batchjob.models.chat import ChatTemplateError, compile_template

    if template is None:
        return  # rows say that the model has no template, one by one (as in a job)
    try:
        compile_template(template)
    except ChatTemplateError as e:
        raise ValueError(f"chat_template: {e}") from None
