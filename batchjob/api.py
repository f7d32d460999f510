"""The Python API: `generate()` runs prompts (and `chat()` conversations, `embed()` texts) in memory and `run()` runs a job,
with the engine, sampling and chat handling of `batchjob run`. An `LLM` holds one loaded model and its
engine; `generate()` keeps the last few in a cache keyed by model and engine knobs, so a notebook does not
reload a model per call."""
from __future__ import annotations

import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from batchjob.engine.engine import Engine
from batchjob.errors import ChatHintWarning
from batchjob.job.options.config import ConfigError, JobConfig, job_values, load_job
from batchjob.job.rows.embed_task import resolve_pooling
from batchjob.job.engine_setup import adapter_slots, build_models, engine_for
from batchjob.job.rows.in_memory import Result, run_in_memory, score_records
from batchjob.job.rows.chat_templates import check_chat_template, template_text
from batchjob.job.options.keywords import api_words, check_names, job_config
from batchjob.job.options.modes import Task
from batchjob.job.options.options import TEXT_LISTS, Api, api_keywords
from batchjob.job.rows.tool_rows import ToolRows, carries_tools
from batchjob.job.rows.prompt_builder import PromptBuilder
from batchjob.job.rows.prompt_records import conversation_records, prompt_records
from batchjob.job.rows.images import ImageRows
from batchjob.job.options.resolved import ResolvedJob
from batchjob.job.rows.row_server import RowServer
from batchjob.job.rows.results import Completion
from batchjob.job.run import run_job
from batchjob.job.report.summary import JobSummary
from batchjob.models.loader import resolve_model_path

__all__ = ["LLM", "Completion", "Result", "cached_llm", "chat", "clear_cache", "embed", "generate", "run",
           "score"]

# the keywords, named as in a job file (and vLLM), from the options table (job/options/options.py); `seed` is the job seed:
# row i's random stream comes from (seed, i), as row i of `batchjob run` (a prompt dict's own `seed` is that row's)
SAMPLING_OPTIONS = api_keywords(Api.SAMPLING)
CHAT_OPTIONS = api_keywords(Api.CHAT)
EMBED_OPTIONS = api_keywords(Api.EMBED)  # embed()'s keywords (docs/guide/embeddings.md)
SCORE_OPTIONS = api_keywords(Api.SCORE)  # score()'s keywords besides the continuations (docs/guide/scoring.md)
ENGINE_OPTIONS = api_keywords(Api.ENGINE)
STRUCTURED_KEYS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                   "grammar": "grammar"}  # structured_outputs={...} (vLLM's names) -> the job field
SAMPLING_KEYWORDS = SAMPLING_OPTIONS + ("structured_outputs", "lora")  # lora: an adapter of LLM(adapters=...)
GENERATE_KEYWORDS = SAMPLING_KEYWORDS + CHAT_OPTIONS  # generate()'s
CHAT_KEYWORDS = tuple(k for k in GENERATE_KEYWORDS if k != "chat")  # chat()'s: a conversation is a chat already
# LLM()'s: the engine's, and every call's as the defaults of the calls that take them (a call's own keywords win)
LLM_KEYWORDS = tuple(dict.fromkeys(ENGINE_OPTIONS + GENERATE_KEYWORDS + EMBED_OPTIONS + SCORE_OPTIONS))
CACHE_SIZE = 2  # loaded engines generate() keeps (each holds its weights and its KV cache)


class LLM:
    """A model loaded once, with its engine: `LLM(model="smollm2", dtype=..., max_num_seqs=...)`, then
    `.generate(prompts, temperature=..., ...)` or `.chat(conversations, ...)` as often as needed. `model`:
    "smollm2" (the embedded SmolLM2-135M-Instruct), a Hugging Face folder or a .gguf file; the keywords are
    the job file's fields the API takes (batchjob.api.LLM_KEYWORDS): the engine's (ENGINE_OPTIONS: dtype, device,
    kernels, max_num_seqs, max_model_len, kv_cache_gb, kv_cache_dtype, quantization, adapters, ...) and any call's
    (reasoning_parser, tool_parser, chat_template, max_tokens, pooling, ...), which become the defaults of the calls
    that take them (a call's own keywords win). Raises ConfigError (a bad keyword or value), ModelLoadError,
    UnsupportedModelError, KernelError (QuantizationError among them) or KvBudgetError. Calls are serialized (one engine)."""

    def __init__(self, model: str = "smollm2", **options: Any):
        check_names(options, LLM_KEYWORDS, "LLM()")
        engine = {k: v for k, v in options.items() if k in ENGINE_OPTIONS}
        self.defaults = {k: v for k, v in options.items() if k not in ENGINE_OPTIONS and v is not None}
        with api_words():
            self.options = {k: v for k, v in engine.items() if v is not None}
            self.config = job_config({"model": model, **self.options})
            self.resolved = job = ResolvedJob.of(self.config)  # device, dtype and threads: "auto" decided once
            torch.set_num_threads(job.threads)
            self.loaded = job.load(model)
            self.tokenizer = self.loaded.tokenizer
            self._images = ImageRows.of(self.loaded, resolve_model_path(model))  # None: a text-only model
            self._models = build_models(job, self.loaded)  # they take the weights
            self._engine: Engine | None = engine_for(self.config, self.loaded, *self._models)
        self._lock = threading.Lock()
        checked = self._with_defaults({}, GENERATE_KEYWORDS)
        checked.pop("lora", None)  # a prompt's adapter, named per prompt
        self._prepare([], checked)  # the calls' defaults checked now, not at a call
        for task, names in ((Task.EMBED, EMBED_OPTIONS), (Task.SCORE, SCORE_OPTIONS)):
            given = self._with_defaults({}, names)
            if given:
                with api_words():
                    job_config({"model": model, **self.options, "task": task, **given})

    def _with_defaults(self, options: dict, names: tuple[str, ...]) -> dict:
        """A call's keywords over the defaults given to LLM() that such a call takes."""
        return {**{k: v for k, v in self.defaults.items() if k in names}, **options}

    @property
    def kernels(self) -> str:
        return self.engine.model.kernels.name

    @property
    def engine(self) -> Engine:
        if self._engine is None:  # the last call stopped midway (Ctrl-C): its rows are still in the old engine
            with api_words():
                self._engine = engine_for(self.config, self.loaded, *self._models)
        return self._engine

    def generate(self, prompts: Any, **options: Any) -> list[Result]:
        """One Result per prompt, in input order. `prompts`: a prompt or a list of them, each a string, a list
        of token ids, a conversation (a list of {role, content}) or a dict of a job row's fields (prompt or
        prompt_token_ids, messages, per-prompt sampling, tools). `options` (GENERATE_KEYWORDS): sampling
        parameters (SAMPLING_OPTIONS), structured_outputs, lora and the chat options (CHAT_OPTIONS: chat,
        chat_template, system_prompt, chat_template_kwargs, reasoning_parser, tool_parser, ...). A bad keyword or value raises ValueError (ConfigError); a bad
        prompt is a Result with an error. Plain prompts that end at their first token from a model with a chat
        template warn (ChatHintWarning): the model probably wants chat=True."""
        check_names(options, GENERATE_KEYWORDS, "generate()")
        return self._run(prompt_records(prompts), self._with_defaults(options, GENERATE_KEYWORDS))

    def chat(self, conversations: Any, **options: Any) -> list[Result]:
        """One Result per conversation, as vLLM's `LLM.chat`: `conversations` is one conversation (a list of
        {role, content} messages) or a list of them, each rendered with the model's chat template (or
        chat_template=, a file or the Jinja text) and a generation prompt. `options`: generate()'s less `chat`
        (CHAT_KEYWORDS): sampling parameters, chat_template, system_prompt (prepended to a conversation that has no
        system message), chat_template_kwargs, reasoning_parser, tool_parser, limit_images_per_prompt."""
        check_names(options, CHAT_KEYWORDS, "chat()")
        return self._run(conversation_records(conversations), self._with_defaults(options, CHAT_KEYWORDS))

    def embed(self, texts: Any, **options: Any) -> list[Result]:
        """One Result per text, in input order, with `.embedding` (a list of floats), as `--task embed`:
        prefill only, the final normed hidden states pooled. `texts`: a string, a list of token ids, or a list
        of them. `options`: pooling (last | mean | cls; default: the model folder's 1_Pooling/config.json, else
        last), normalize (L2, default True), dimensions (keep the first N, then normalise), embed_prefix
        (prepended to each text). No chat template is applied."""
        check_names(options, EMBED_OPTIONS, "embed()")
        options = self._with_defaults(options, EMBED_OPTIONS)
        with api_words():
            cfg = job_config({"model": self.config.model, **self.options, "task": Task.EMBED, **options})
            cfg = resolve_pooling(cfg, resolve_model_path(self.config.model))
        builder = PromptBuilder(cfg, self.tokenizer, use_messages=False, in_memory=True)
        with self._lock:
            try:
                return self._generate(cfg, builder, prompt_records(texts))
            except BaseException:
                self._engine = None
                raise

    def score(self, prompts: Any, continuations: Any = None, **options: Any) -> list[Result]:
        """One Result per prompt, in input order, as `--task score`: prefill only, each prompt token's logprob
        (`.prompt_logprobs`, None first; `.prompt_logprob_sum`). `continuations`: None, or one per prompt
        (a string, or token ids when the prompt is token ids): it is scored after its prompt, as
        lm-evaluation-harness's loglikelihood (`.continuation_logprob`, `.continuation_tokens`, `.is_greedy`).
        `options`: prompt_logprobs (the top N alternatives per position in `.prompt_top_logprobs`). No chat
        template is applied."""
        check_names(options, SCORE_OPTIONS, "score()")
        options = self._with_defaults(options, SCORE_OPTIONS)
        records = score_records(prompts, continuations)
        with api_words():
            cfg = job_config({"model": self.config.model, **self.options, "task": Task.SCORE, **options})
        builder = PromptBuilder(cfg, self.tokenizer, use_messages=False, in_memory=True)
        with self._lock:
            try:
                return self._generate(cfg, builder, records)
            except BaseException:
                self._engine = None
                raise

    def _run(self, records: list[dict | str], options: dict) -> list[Result]:
        lora = options.pop("lora", None)  # the adapter of every prompt that names none (vLLM's lora_request)
        if lora is not None:
            records = [{"lora": lora, **r} if isinstance(r, dict) else r for r in records]
        cfg, builder = self._prepare(records, options)
        with self._lock:
            try:
                results = self._generate(cfg, builder, records)
            except BaseException:  # e.g. Ctrl-C in a notebook: rows are left in the engine; start clean next time
                self._engine = None
                raise
        self._chat_hint(cfg, records, results)
        return results

    def _prepare(self, records: list[dict | str], options: dict) -> tuple[JobConfig, PromptBuilder]:
        """The job config of a call's options and its prompt builder (the chat template checked where used)."""
        template = template_text(options.pop("chat_template", None))
        structured = options.pop("structured_outputs", None)
        if structured is not None:  # vLLM's dict, for every prompt (a prompt's own `structured_outputs` wins)
            if not isinstance(structured, dict) or len(structured) != 1 or next(iter(structured)) not in STRUCTURED_KEYS:
                raise ConfigError(f"structured_outputs: expected one of {', '.join(STRUCTURED_KEYS)} as its one key, "
                                  f"got {structured!r:.80}")
            (key, value), = structured.items()
            options[STRUCTURED_KEYS[key]] = value
        for name in TEXT_LISTS:  # one text (a stop string), never the job flag's JSON list text
            if isinstance(options.get(name), str):
                options[name] = [options[name]]
        system_prompt = options.get("system_prompt")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(f"system_prompt: expected a string, got {system_prompt!r}")
        # prompts with tools and no tool_parser: auto, as a job's (job/inputs.py)
        implied = options.get("tool_parser") is None and any(isinstance(r, dict) and carries_tools(r) for r in records)
        with api_words():
            cfg = job_config({"model": self.config.model, **self.options, **options,
                              **({"tool_parser": "auto"} if implied else {})})
            tool_rows = ToolRows.of(cfg.tool_parser, self.tokenizer, template, implied=implied,
                                    reasoning_parser=cfg.reasoning_parser)
        chat = cfg.chat or any(isinstance(r, dict) and r.get("messages") is not None for r in records)
        if chat:
            check_chat_template(template or self.tokenizer.chat_template)
        elif records and cfg.chat_template_kwargs:  # as a job of plain prompts (job/inputs.py)
            raise ConfigError("chat_template_kwargs: the prompts are plain prompts, which no chat template renders, so "
                              "its variables would be ignored; pass chat=True (each prompt becomes a user message) or "
                              "call chat()")
        return cfg, PromptBuilder(cfg, self.tokenizer, use_messages=True, chat_template=template, in_memory=True,
                                  images=self._images, image_base=Path.cwd(), model_name=self.loaded.name,
                                  tool_rows=tool_rows,
                                  adapters=adapter_slots(cfg))

    def _chat_hint(self, cfg: JobConfig, records: list[dict | str], results: list[Result]) -> None:
        """Plain prompts into a model with a chat template that ended at their first token (an instruct model's
        end of turn, so the text is empty): warn, as `batchjob run` prints its hint. Any such prompt warns: a
        call's results are all in hand, and an empty text is a lost answer."""
        if cfg.chat or self.tokenizer.chat_template is None:
            return
        plain = [r for rec, r in zip(records, results)  # text prompts (token ids may be a rendered chat already)
                 if isinstance(rec, dict) and rec.get("messages") is None and isinstance(rec.get("prompt"), str)
                 and r.finish_reason != "error"]
        first = sum(r.finish_reason == "stop" and len(r.token_ids) <= 1 for r in plain)
        if first:
            warnings.warn(f"{first} of {len(plain)} prompts ended at their first token; {self.loaded.name} has a chat "
                          "template, so it probably expects chat input: pass chat=True (each prompt becomes a user "
                          "message) or call LLM.chat(conversations)", ChatHintWarning, stacklevel=_caller_level())

    def _generate(self, cfg: JobConfig, builder: PromptBuilder, records: list[dict | str]) -> list[Result]:
        return run_in_memory(self.engine, self.tokenizer, cfg, builder, records)

    def row_server(self, options: dict) -> RowServer:
        """A RowServer over this LLM's engine for callers that hand it batches of records from several threads (Ray
        Data's LLMStage: batchjob/ray/stage.py): `options` as generate() takes them; the engine is rebuilt if a batch
        leaves it broken."""
        cfg, builder = self._prepare([], dict(options))

        def reset() -> None:
            self._engine = None

        return RowServer(lambda: self.engine, self.tokenizer, cfg, builder, reset)



# the cache behind generate()

_cache: OrderedDict[tuple, LLM] = OrderedDict()
_cache_lock = threading.Lock()


def cached_llm(model: str = "smollm2", **engine: Any) -> LLM:
    """The cached LLM for this model and these engine knobs, loaded on first use; the least recently used
    one goes when more than CACHE_SIZE are held. `threads` is process-wide, so it is set, not keyed."""
    check_names(engine, ENGINE_OPTIONS, "generate()")
    threads = engine.pop("threads", None)
    with api_words():
        cfg = job_config({"model": model, "threads": threads, **engine})
        job = ResolvedJob.of(cfg)
        key = (str(resolve_model_path(model)), job.device, str(job.dtype),
               *((name, getattr(cfg, name)) for name in ENGINE_OPTIONS if name not in ("dtype", "device", "threads")))
    torch.set_num_threads(job.threads)
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
    """Generate text for `prompts` in memory, with the engine and sampling of `batchjob run`.

    prompts: one prompt or a list of prompts; each is
      - a string: a plain completion prompt (as vLLM's generate; chat=True makes it a user message),
      - a list of token ids: used as they are,
      - a conversation: a list of {"role", "content"} messages, rendered with the model's chat template,
      - a dict of a job row's fields: "prompt" (text or token ids) or "prompt_token_ids", or "messages",
        plus per-prompt sampling ("max_tokens", "temperature", "seed", a "sampling" dict, ...).
    model: "smollm2" (the embedded SmolLM2-135M-Instruct, the default), a Hugging Face folder or a .gguf file.
    Sampling keywords: max_tokens (256), min_tokens, temperature (0 = greedy), top_k, top_p, min_p,
      repetition_penalty, presence_penalty, frequency_penalty, stop (a string or a list), stop_token_ids,
      include_stop_str_in_output, ignore_eos, logprobs (top-N per token), n (completions per prompt), seed
      (prompt i's random stream comes from (seed, i), as row i of a job).
      Also max_reasoning_tokens, structured_outputs (vLLM's dict) and lora (an adapter loaded with adapters=).
    Chat keywords: chat (wrap plain prompts as user messages), chat_template (a file or the Jinja text),
      system_prompt, chat_template_kwargs, reasoning_parser, tool_parser, limit_images_per_prompt (CHAT_OPTIONS).
    Engine keywords (the engine is loaded once per model and engine keywords, and cached): dtype, device,
      kernels, threads, max_num_seqs, max_num_batched_tokens, max_model_len, kv_cache_gb, kv_cache_dtype, quantization,
      gpu_memory_utilization, block_size, prefix_caching, speculative, ... (batchjob.api.ENGINE_OPTIONS).

    Returns one Result per prompt, in order: text, finish_reason (stop | length | error), prompt_tokens,
    completion_tokens, error, logprobs, completions (n > 1), token_ids. A prompt that cannot run (empty, too
    long, a bad per-prompt parameter) is a Result with finish_reason "error", the others still run.
    Raises ConfigError (a ValueError) for an unknown keyword or a bad value; ModelLoadError or
    UnsupportedModelError for a model that cannot load; KernelError or KvBudgetError for an engine that
    cannot run here. Warns (ChatHintWarning) when plain prompts end at their first token from a model with
    a chat template: it probably wants chat=True or batchjob.chat()."""
    check_names(options, GENERATE_KEYWORDS + ENGINE_OPTIONS, "generate()")
    engine = {k: v for k, v in options.items() if k in ENGINE_OPTIONS}
    call = {k: v for k, v in options.items() if k not in ENGINE_OPTIONS}
    return cached_llm(model, **engine).generate(prompts, **call)


def chat(conversations: Any, *, model: str = "smollm2", **options: Any) -> list[Result]:
    """Chat in memory, as vLLM's `LLM.chat`: `conversations` is one conversation (a list of {"role",
    "content"} messages) or a list of them, each rendered with the model's chat template and a generation
    prompt. Returns one Result per conversation. The keywords are generate()'s, less `chat`: sampling, chat
    (chat_template, system_prompt, chat_template_kwargs, reasoning_parser, tool_parser, ...) and the engine's; the
    same errors."""
    check_names(options, CHAT_KEYWORDS + ENGINE_OPTIONS, "chat()")
    engine = {k: v for k, v in options.items() if k in ENGINE_OPTIONS}
    call = {k: v for k, v in options.items() if k not in ENGINE_OPTIONS}
    return cached_llm(model, **engine).chat(conversations, **call)


def embed(texts: Any, *, model: str = "smollm2", **options: Any) -> list[Result]:
    """Embeddings of `texts` in memory, as `batchjob run --task embed`: one Result per text with `.embedding`
    (a list of floats; prompt_tokens as usual, text empty, finish_reason "stop", or "error" with `.error`).
    Keywords: pooling (last | mean | cls; default: the model folder's sentence-transformers
    1_Pooling/config.json, else last), normalize (L2; default True), dimensions (Matryoshka: the first N,
    then normalised), embed_prefix (prepended to each text, e.g. "query: "), and the engine keywords of
    generate() (the engine is cached as generate()'s)."""
    check_names(options, EMBED_OPTIONS + ENGINE_OPTIONS, "embed()")
    engine = {k: v for k, v in options.items() if k in ENGINE_OPTIONS}
    call = {k: v for k, v in options.items() if k not in ENGINE_OPTIONS}
    return cached_llm(model, **engine).embed(texts, **call)


def score(prompts: Any, continuations: Any = None, *, model: str = "smollm2", **options: Any) -> list[Result]:
    """Scores in memory, as `batchjob run --task score` (LLM.score): each prompt token's logprob, and with
    `continuations` (one per prompt) each continuation's summed logprob and is_greedy, lm-evaluation-harness's
    loglikelihood. Keywords: prompt_logprobs (top-N alternatives per position) and the engine keywords of
    generate() (the engine is cached as generate()'s)."""
    check_names(options, SCORE_OPTIONS + ENGINE_OPTIONS, "score()")
    engine = {k: v for k, v in options.items() if k in ENGINE_OPTIONS}
    call = {k: v for k, v in options.items() if k not in ENGINE_OPTIONS}
    return cached_llm(model, **engine).score(prompts, continuations, **call)


def run(job: str | Path | Mapping[str, Any], *, restart: bool = False, **overrides: Any) -> JobSummary:
    """Run a job as `batchjob run` does: `job` is a TOML job file or a dict of the same fields (with
    optional sampling/engine/output/job tables); `overrides` are job fields that win over it; restart=True
    deletes the output folder's results first. Returns the summary; failures raise the project's errors
    (ConfigError, SourceError, ModelLoadError, SinkError, TooManyErrors, KernelError, ...)."""
    with api_words():
        values = job_values(overrides, "run()")
        if isinstance(job, Mapping):
            job_file, values = None, {**job_values(job, "run()"), **values}
        elif isinstance(job, (str, Path)):
            job_file = str(job)
        else:
            raise ConfigError(f"run(): job: expected a job file path or a dict of job fields, got {type(job).__name__}")
        cfg = load_job(job_file, values)
        from batchjob.launch.local import data_parallel_summary, run_data_parallel, wants_ranks

        if wants_ranks(cfg.data_parallel):  # N rank processes on this node (batchjob/launch/local.py)
            return data_parallel_summary(run_data_parallel(job_file, values, cfg, restart=restart,
                                                           log=lambda text: print(text, file=sys.stderr)), cfg)
        return run_job(cfg, restart=restart)


def _caller_level() -> int:
    """warnings.warn's stacklevel that names the caller's line: the first frame outside batchjob."""
    frame, level, here = sys._getframe(1), 1, str(Path(__file__).parent)
    while frame is not None and frame.f_code.co_filename.startswith(here):
        frame, level = frame.f_back, level + 1
    return level
