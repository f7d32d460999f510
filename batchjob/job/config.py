"""JobConfig: one typed object built from the job file (TOML) plus CLI flags, validated once here."""
from __future__ import annotations

import dataclasses
import difflib
import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from batchjob.errors import ConfigError  # noqa: F401 - raised here, re-exported for callers


@dataclass(slots=True)
class JobConfig:
    # what to run
    task: str = "generate"  # generate | embed (a pooled `embedding` per row) | score (prompt logprobs); both prefill only
    model: str = "smollm2"  # "smollm2" (embedded GGUF), a path (HF folder or .gguf file), or an org/name id in the HF cache
    input: str = ""
    output: str = ""  # default: out/<job file name>
    input_format: str | None = None
    prompt_column: str = "prompt"
    messages_column: str = "messages"  # used when the input has this column
    continuation_column: str = "continuation"  # task = "score": the text scored after the prompt, when a row has it
    chat: bool = False  # wrap a plain prompt as a user message and apply the chat template
    chat_template: str | None = None  # a file overriding the model's template
    system_prompt: str | None = None
    keep_columns: list[str] = field(default_factory=list)
    # the input column that identifies a row, copied into the output; None: `id` or `custom_id` when the input has one
    id_column: str | None = None
    # sampling
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)  # stop strings
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token
    prompt_logprobs: int | None = None  # each prompt token's logprob with the top-n alternatives (score: default 0)
    n: int = 1  # completions per row
    # structured outputs for every row (a row's own `structured_outputs` wins); at most one of these
    json_schema: str | dict | None = None  # a JSON schema: a file, JSON text, or a TOML table
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] = field(default_factory=list)  # the output is one of these strings
    grammar: str | None = None  # a Lark or GBNF grammar: a file, or its text
    # embed (task = "embed"; docs/guide/embeddings.md)
    pooling: str | None = None  # last | mean | cls; None: the model folder's 1_Pooling/config.json, else last
    normalize: bool = True  # L2-normalise each embedding
    dimensions: int | None = None  # Matryoshka: keep the first N values (then normalise)
    embed_prefix: str = ""  # text prepended to each prompt (an instruction, e.g. "query: ")
    truncate: bool = False  # a prompt past the context keeps its first tokens (else the row fails), as TEI does
    # engine
    dtype: str | None = None  # float32 | bfloat16 | float16; default: measured choice for the device
    device: str | None = None  # cpu | cuda; default cuda when available
    kernels: str = "auto"  # auto | torch | native | triton (kernels/dispatch.py)
    scheduling: str = "continuous"  # continuous | static
    batch_size: int = 16  # static batching's batch size
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    prefill_chunk: int = 0
    block_size: int = 16
    kv_cache_gb: float | None = None  # None: 1 GiB on the CPU; on CUDA, sized by gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # CUDA: share of the device's memory for weights, activations and KV
    cuda_graphs: bool = True  # CUDA + Triton kernels: decode steps replay captured CUDA graphs
    kv_cache_dtype: str = "auto"  # auto (the compute dtype) | int8 | int4: quantized KV (kernels/reference/kv_quant.py)
    quantization: str = "auto"  # auto (the checkpoint's: none for a float one) | none | int8 (W8A8 at load,
    # kernels/linear_int8.py) | fp8 (CUDA, cap >= 8.9: kernels/linear_fp8.py): weight matmuls; a pre-quantized
    # checkpoint's own wins (resolved_quantization)
    async_scheduling: str = "auto"  # auto (on CUDA) | on | off: schedule step N+1 while step N runs
    speculative: str = "none"  # none | ngram (prompt lookup) | draft (a smaller model proposes: --draft-model)
    num_speculative_tokens: int = 4  # tokens proposed per row and step
    speculative_max_rows: int = 32  # no proposals in a step with more decoding rows than this
    draft_model: str | None = None  # speculative = "draft": a smaller model with the target's tokenizer
    read_ahead: int = 0  # rows queued in the engine per lane beyond the running ones; 0 = 2 x max_num_seqs
    max_model_len: int | None = None  # cap on a row's prompt + generated tokens; None: the model's context
    threads: int = 0  # 0 = the CPUs this process may use (job/threads.py)
    limit: int | None = None  # run only the first N input rows (a trial run); a rerun without it continues
    # scheduler (docs/guide/scheduling.md)
    admission: str = "optimistic"  # optimistic | reserve
    preemption: str = "auto"  # auto | recompute | swap
    swap_space_gb: float = 1.0
    max_wait: float = 300.0
    prefix_caching: bool = True
    lanes: list[dict] = field(default_factory=list)  # [[lanes]] name, priority, weight, input, max_tokens
    lane_column: str = "lane"  # rows name their lane here (or carry a `priority` column) when lanes have no input
    # output
    part_rows: int = 1000
    part_seconds: float = 30.0
    part_format: str = "arrow"  # arrow (IPC files) | parquet
    progress: bool = True
    log_every: float = 30.0  # seconds between plain progress lines when stderr is not a terminal
    # stopping; not part of the job's identity, so changing them never blocks a resume
    drain_timeout: float = 60.0  # seconds the running rows get to finish after SIGINT/SIGTERM/SIGUSR1
    max_errors: int | float | None = None  # failed rows allowed: a count (10) or a fraction of the rows (0.1); None: any
    output_format: str = "arrow"  # arrow | openai-batch (also OUTPUT/results.jsonl at the end)
    # sharding: "K/N" runs the K-th (0-based) of N contiguous slices into OUTPUT/shard-K-of-N/;
    # unset inside a Slurm array task: K/N from SLURM_ARRAY_TASK_*; "none": never shard
    shard: str | None = None
    # where the values came from (not a job-file field): the job file, for messages
    job_file: str | None = None

    def validate(self) -> "JobConfig":
        if not self.input and not self.per_lane_inputs:
            where = f"set `input = \"PATH\"` in {self.job_file} or pass --input PATH" if self.job_file else "pass --input PATH"
            raise ConfigError(f"input: no input given; {where}")
        _choice("scheduling", self.scheduling, ("continuous", "static"))
        self._validate_task()
        if self.dtype is not None:
            _choice("dtype", self.dtype, ("float32", "bfloat16", "float16"))
        if self.device is not None:
            _choice("device", self.device, ("cpu", "cuda"))
        _choice("kernels", self.kernels, ("auto", "torch", "native", "triton"))
        for name in ("max_tokens", "max_num_seqs", "max_num_batched_tokens", "block_size", "batch_size", "part_rows"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ConfigError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.prefill_chunk < 0 or self.read_ahead < 0:
            raise ConfigError("top_k, prefill_chunk and read_ahead must be >= 0")
        if self.threads < 0:
            raise ConfigError(f"threads: must be >= 1 (or 0 = the CPUs this process may use), got {self.threads}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit: must be >= 1 rows, got {self.limit}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len: must be >= 2 tokens (a prompt token and a generated one), got {self.max_model_len}")
        if self.log_every <= 0:
            raise ConfigError(f"log_every: must be > 0 seconds, got {self.log_every}")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ConfigError(f"kv_cache_gb: must be > 0, got {self.kv_cache_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        from batchjob.engine.spec_decode.config import speculative_config

        try:
            speculative_config(self.speculative, self.num_speculative_tokens, self.speculative_max_rows, self.draft_model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _choice("async_scheduling", self.async_scheduling, ("auto", "on", "off"))
        _choice("kv_cache_dtype", self.kv_cache_dtype, ("auto", "int8", "int4"))
        _choice("quantization", self.quantization, ("auto", "none", "int8", "fp8"))
        _choice("admission", self.admission, ("optimistic", "reserve"))
        _choice("preemption", self.preemption, ("auto", "recompute", "swap"))
        if self.max_wait <= 0:
            raise ConfigError(f"max_wait: must be > 0 seconds, got {self.max_wait}")
        if self.drain_timeout < 0:
            raise ConfigError(f"drain_timeout: must be >= 0 seconds, got {self.drain_timeout}")
        self.max_errors = _error_limit(self.max_errors)
        self._validate_lanes()
        _choice("output_format", self.output_format, ("arrow", "openai-batch"))
        _choice("part_format", self.part_format, ("arrow", "parquet"))
        try:
            self.sampling_defaults()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.shard is not None:
            from batchjob.cluster.shards import ShardSpec

            ShardSpec.resolve(self.shard)  # the one K/N parser; raises ConfigError naming the field
        return self

    def sampling_defaults(self, max_tokens: int | None = None):
        """The job's SamplingParams (a lane may set its own max_tokens); rows may override each field."""
        from batchjob.engine.requests import SamplingParams

        score = self.task == "score"  # a scoring row: max_tokens 0, prompt logprobs (0: no alternatives)
        return SamplingParams.parse({
            "max_tokens": 0 if score else max_tokens or self.max_tokens, "min_tokens": self.min_tokens, "temperature": self.temperature,
            "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty, "stop": self.stop,
            "stop_token_ids": self.stop_token_ids, "include_stop_str_in_output": self.include_stop_str_in_output,
            "ignore_eos": self.ignore_eos, "logprobs": self.logprobs, "n": self.n,
            "prompt_logprobs": (self.prompt_logprobs or 0) if score else self.prompt_logprobs,
            "structured_outputs": self.structured_outputs(), "pooling": self.pooling_params(),
        })

    def pooling_params(self):
        """The embed task's PoolingParams (None for generate); an unset pooling is `last` until the job
        resolves it from the model folder (job/embed_task.py)."""
        from batchjob.engine.requests import PoolingParams

        if self.task != "embed":
            return None
        return PoolingParams(self.pooling or "last", self.normalize, self.dimensions)

    def _validate_task(self) -> None:
        _choice("task", self.task, ("generate", "embed", "score"))
        if self.pooling is not None:
            _choice("pooling", self.pooling, ("last", "mean", "cls"))
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ConfigError(f"dimensions: must be an integer >= 1, got {self.dimensions!r}")
        if self.task != "embed":
            given = [name for name, unset in (("pooling", self.pooling is None), ("dimensions", self.dimensions is None),
                                              ("embed_prefix", not self.embed_prefix),
                                              ("truncate", not self.truncate)) if not unset]
            if given:
                raise ConfigError(f"{given[0]}: applies to task = \"embed\" only (this job's task is {self.task}); "
                                  "add --task embed")
        if self.task == "generate":
            return
        clash = [name for name, on in (("chat", self.chat), ("logprobs", self.logprobs is not None), ("n", self.n != 1),
                                       ("speculative", self.speculative != "none"),
                                       ("prompt_logprobs", self.task == "embed" and self.prompt_logprobs is not None),
                                       ("structured outputs", self.structured_outputs() is not None)) if on]
        if clash:
            raise ConfigError(f"{clash[0]}: not with task = \"{self.task}\" (its rows are one prefill each and generate "
                              "nothing; chat templates are not applied to them)")

    def structured_outputs(self) -> dict | None:
        """The job-wide structured_outputs (vLLM's names) from json_schema / json_object / regex / choice / grammar."""
        given = {name: value for name, value in (("json_schema", self.json_schema), ("json_object", self.json_object or None),
                                                ("regex", self.regex), ("choice", self.choice or None),
                                                ("grammar", self.grammar)) if value is not None}
        if len(given) > 1:
            raise ConfigError(f"{', '.join(given)}: give at most one structured output for the job "
                              "(json_schema, json_object, regex, choice or grammar)")
        if not given:
            return None
        (name, value), = given.items()
        if name in ("json_schema", "grammar") and isinstance(value, str) and _is_file(value):
            value = Path(value).read_text()  # a file; else the text itself
        if name == "json_schema" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConfigError(f"json_schema: {value!r:.80} is neither a file nor JSON text ({e})") from None
        return {"json" if name == "json_schema" else name: value}

    @property
    def per_lane_inputs(self) -> bool:
        return bool(self.lanes) and all(isinstance(lane, dict) and lane.get("input") for lane in self.lanes)

    def _validate_lanes(self) -> None:
        allowed = {"name", "priority", "weight", "input", "max_tokens"}
        names = set()
        for i, lane in enumerate(self.lanes):
            where = f"lanes[{i}]"
            if not isinstance(lane, dict):
                raise ConfigError(f"{where}: expected a table with {', '.join(sorted(allowed))}")
            unknown = set(lane) - allowed
            if unknown:
                raise ConfigError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(allowed))}")
            name = lane.get("name")
            if not isinstance(name, str) or not name or "/" in name:
                raise ConfigError(f"{where}.name: a non-empty name without '/' is required")
            if name in names:
                raise ConfigError(f"{where}.name: lane {name!r} is declared twice")
            names.add(name)
            if not isinstance(lane.get("priority", 0), int):
                raise ConfigError(f"{where}.priority: expected an integer")
            w = lane.get("weight", 1.0)
            if not isinstance(w, (int, float)) or w <= 0:
                raise ConfigError(f"{where}.weight: expected a number > 0")
            mt = lane.get("max_tokens")
            if mt is not None and (not isinstance(mt, int) or mt < 1):
                raise ConfigError(f"{where}.max_tokens: expected an integer >= 1")
        with_input = [lane.get("input") is not None for lane in self.lanes]
        if any(with_input) and not all(with_input):
            raise ConfigError("lanes: either every lane names its own `input` (per-lane outputs) or none does "
                              "(rows choose their lane by the lane column or a `priority` column)")


def _error_limit(value) -> int | float | None:
    """max_errors: None, a count (10, "10"), or a fraction of the rows (0.1, "0.1", "10%")."""
    if value is None:
        return None
    try:
        if isinstance(value, str):
            text = value.strip()
            value = float(text[:-1]) / 100 if text.endswith("%") else (int(text) if text.isdigit() else float(text))
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, float) and value.is_integer() and value >= 1:
            value = int(value)
        if isinstance(value, int) and value >= 0 or isinstance(value, float) and 0 < value < 1:
            return value
    except ValueError:
        pass
    raise ConfigError(f"max_errors: expected a number of rows (e.g. 10) or a fraction of the rows between 0 and 1 "
                      f"(e.g. 0.1 or 10%), got {value!r}")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(allowed)}")


FIELDS = {f.name: f for f in dataclasses.fields(JobConfig) if f.name != "job_file"}
# The job file's optional tables and the fields each holds; every field may also stand at the top level
# (a `[job]` table holds any field, as the top level does).
TABLES: dict[str, tuple[str, ...]] = {
    "sampling": ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "include_stop_str_in_output", "ignore_eos", "min_tokens", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "logprobs", "prompt_logprobs", "n"),
    "engine": ("dtype", "device", "kernels", "threads", "scheduling", "batch_size", "max_num_seqs",
               "max_num_batched_tokens", "prefill_chunk", "block_size", "kv_cache_gb", "gpu_memory_utilization",
               "kv_cache_dtype", "quantization", "swap_space_gb", "admission", "preemption", "max_wait", "prefix_caching",
               "read_ahead", "async_scheduling", "cuda_graphs", "speculative", "draft_model",
               "num_speculative_tokens", "speculative_max_rows", "max_model_len"),
    "embed": ("pooling", "normalize", "dimensions", "embed_prefix", "truncate"),
    "structured_outputs": ("json_schema", "json_object", "regex", "choice", "grammar"),
    "output": ("part_rows", "part_seconds", "part_format", "output_format", "keep_columns", "id_column"),
}
SECTIONS = (*TABLES, "job")  # optional TOML tables; their keys are fields too


def load_job(path: str | Path | None, overrides: dict) -> JobConfig:
    """Job file values, then every non-None override; relative paths in the file are taken from the cwd.
    A bad value that came from the file is reported with the file's name."""
    values: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"job file {p} not found")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
        values = job_values(data, str(p))
    given = {k: v for k, v in overrides.items() if v is not None}
    from_file = set(values) - set(given)
    if path is not None:
        values.setdefault("output", str(Path("out") / Path(path).stem))
    values.update(given)
    if not values.get("output"):
        values["output"] = str(Path("out") / (Path(values.get("input") or "job").stem or "job"))
    cfg = JobConfig(job_file=str(path) if path is not None else None)
    try:
        for k, v in values.items():
            setattr(cfg, k, _coerce(k, v))
        return cfg.validate()
    except ConfigError as e:
        raise _naming_the_file(e, path, from_file) from None


def job_values(data: Mapping, where: str) -> dict:
    """A job's fields from a job file's tables (or run()'s dict of them). Every unknown key is reported at once,
    each with the field it probably meant, and a field in another table's place is refused; `where` (the
    file) starts the message."""
    values, problems = {}, []
    for key, value in data.items():
        table = key in SECTIONS and isinstance(value, Mapping)
        for name, v in (value.items() if table else [(key, value)]):
            if name not in FIELDS:
                problems.append((f"unknown field {f'{key}.{name}' if table else name!r}", _close_field(name)))
            elif table and key in TABLES and name not in TABLES[key]:
                problems.append((f"[{key}] {name}: belongs {_place_of(name)}, not in [{key}]", None))
            else:
                values[name] = v
    if problems:
        text = "; ".join(f"{what} (did you mean {close!r}?)" if close else what for what, close in problems)
        if any(what.startswith("unknown") and not close for what, close in problems):
            text += f"; known fields: {', '.join(sorted(FIELDS))}"
        raise ConfigError(f"{where}: {text}")
    return values


def _close_field(name: str) -> str | None:
    """The field a mistyped key probably meant (`temperatur`, `max-tokens`, `Top_P`), or None."""
    key = str(name).lower().replace("-", "_")
    if key in FIELDS:
        return key
    close = difflib.get_close_matches(key, FIELDS, n=1, cutoff=0.75)
    return close[0] if close else None


def _place_of(name: str) -> str:
    table = next((t for t, names in TABLES.items() if name in names), None)
    return f"in [{table}] (or at the top level)" if table else "at the top level (or in [job])"


def _naming_the_file(e: ConfigError, path: str | Path | None, from_file: set[str]) -> ConfigError:
    """A value's error, prefixed with the job file when the field it names ("top_p: ...") came from it."""
    text = str(e)
    named = re.match(r"[a-z_]+", text)
    if path is None or named is None or named.group() not in from_file or text.startswith(str(path)):
        return e
    return ConfigError(f"{path}: {text}")


def _is_file(value: str) -> bool:
    try:
        return "\n" not in value and Path(value).is_file()
    except OSError:  # text too long to be a path
        return False


def _coerce(name: str, value):
    default = FIELDS[name].default
    if name == "limit" and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"limit: expected a number of rows, got {value!r}")
    if name == "max_model_len" and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"max_model_len: expected a number of tokens, got {value!r}")
    if name == "kv_cache_gb" and value is not None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"kv_cache_gb: expected a number of GiB, got {value!r}")
        return float(value)
    if isinstance(default, bool) and not isinstance(value, bool):
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if isinstance(default, float) and not isinstance(value, (int, float)):
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if isinstance(default, float):
        return float(value)
    if name == "lanes":
        if not isinstance(value, list):
            raise ConfigError("lanes: expected [[lanes]] tables")
        return value
    if name == "stop" and isinstance(value, str):  # a flag: one stop string, or a JSON list of them
        if value.lstrip().startswith("["):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConfigError(f"stop: {value!r} is not a JSON list of strings ({e})") from None
        else:
            value = [value]
    if name == "stop":
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"stop: expected a string or a list of strings, got {value!r}")
        return list(value)
    if name in ("keep_columns", "stop_token_ids", "choice"):
        if name == "choice" and isinstance(value, str) and value.lstrip().startswith("["):
            try:
                value = json.loads(value)  # a JSON list: choices that hold commas
            except ValueError as e:
                raise ConfigError(f"choice: {value!r} is not a JSON list of strings ({e})") from None
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return [int(v) for v in value] if name == "stop_token_ids" else [str(v) for v in value]
    return value
