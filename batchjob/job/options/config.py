"""A job's options read and checked once: the job file (TOML) and its tables, the flags and the API's keywords
over it, each value coerced to its option's type (job/options/options.py) and the checks across fields; the result is a
frozen JobConfig."""
from __future__ import annotations

import difflib
import json
import re
import tomllib
import typing
from collections.abc import Mapping
from enum import Enum
from pathlib import Path

from batchjob.engine.config import speculative_config
from batchjob.reasoning.parsers import PARSERS as REASONING_PARSERS, check_parser_name
from batchjob.tool_calls.parsers import PARSERS as TOOL_PARSERS
from batchjob.errors import ConfigError  # noqa: F401 - raised here, re-exported for callers
from batchjob.job.options.modes import Quantization, SpeculativeMethod, Task
from batchjob.job.options.options import FIELDS, OPTIONS, JobConfig, Table, mode_of, names_in, scalar_types

__all__ = ["FIELDS", "SECTIONS", "TABLES", "ConfigError", "JobConfig", "job_values", "load_job", "validate"]

# The job file's optional tables and the fields each holds; every field may also stand at the top level
# (a `[job]` table holds any field, as the top level does).
TABLES: dict[str, tuple[str, ...]] = {t.value: names_in(t) for t in Table if t is not Table.JOB}
SECTIONS = (*TABLES, "job")  # optional TOML tables; their keys are fields too
UNITS = {"limit": "a number of rows", "max_model_len": "a number of tokens", "kv_cache_gb": "a number of GiB"}


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
    try:
        coerced = {k: _coerce(k, v) for k, v in values.items()}
        return validate(JobConfig(**coerced, job_file=str(path) if path is not None else None))
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


def _validate_tensor_parallel(cfg: JobConfig) -> None:
    """What a model split over tensor-parallel ranks does not run (yet): each is refused by name."""
    n = cfg.tensor_parallel
    if n < 1:
        raise ConfigError(f"tensor_parallel: must be >= 1 processes, got {n}")
    if n == 1:
        return
    refused = [(cfg.adapters, "adapters (LoRA)"), (cfg.speculative == SpeculativeMethod.DRAFT, "speculative draft"),
               (cfg.image_column is not None, "image_column (images)"),
               (cfg.quantization not in (Quantization.AUTO, Quantization.NONE), f"quantization {cfg.quantization}")]
    for given, what in refused:
        if given:
            raise ConfigError(f"tensor_parallel: {what} under tensor parallel is not implemented; run without "
                              "--tensor-parallel (or use --data-parallel)")


def validate(cfg: JobConfig) -> JobConfig:
    """The checks across fields and of ranges (each value's type and mode were checked as it was read)."""
    if not cfg.input and not cfg.per_lane_inputs:
        where = f"set `input = \"PATH\"` in {cfg.job_file} or pass --input PATH" if cfg.job_file else "pass --input PATH"
        raise ConfigError(f"input: no input given; {where}")
    _validate_task(cfg)
    for name in ("max_tokens", "max_num_seqs", "max_num_batched_tokens", "block_size", "batch_size", "part_rows"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ConfigError(f"{name}: must be >= 1, got {getattr(cfg, name)}")
    if cfg.image_column is not None and cfg.task != Task.GENERATE:
        raise ConfigError(f"image_column: images are read by generate rows only (this job's task is {cfg.task})")
    if cfg.max_reasoning_tokens is not None and cfg.reasoning_parser is None:
        raise ConfigError(f"max_reasoning_tokens: needs reasoning_parser ({', '.join(REASONING_PARSERS)} or auto), "
                          "which knows where the model's thinking ends")
    if cfg.tool_parser is not None and cfg.tool_parser not in ("auto", *TOOL_PARSERS):
        raise ConfigError(f"tool_parser {cfg.tool_parser!r} is unknown; choices: auto, {', '.join(TOOL_PARSERS)}")
    if cfg.reasoning_parser is not None:
        check_parser_name(cfg.reasoning_parser, ConfigError)
        if cfg.task != Task.GENERATE:
            raise ConfigError(f"reasoning_parser: splits generated text (this job's task is {cfg.task})")
    if cfg.temperature < 0:
        raise ConfigError(f"temperature: must be >= 0, got {cfg.temperature}")
    if not 0 < cfg.top_p <= 1:
        raise ConfigError(f"top_p: must be in (0, 1], got {cfg.top_p}")
    if cfg.top_k < 0 or cfg.prefill_chunk < 0 or cfg.read_ahead < 0:
        raise ConfigError("top_k, prefill_chunk and read_ahead must be >= 0")
    _validate_tensor_parallel(cfg)
    if cfg.threads < 0:
        raise ConfigError(f"threads: must be >= 1 (or 0 = the CPUs this process may use), got {cfg.threads}")
    if cfg.limit is not None and cfg.limit < 1:
        raise ConfigError(f"limit: must be >= 1 rows, got {cfg.limit}")
    if cfg.max_model_len is not None and cfg.max_model_len < 2:
        raise ConfigError(f"max_model_len: must be >= 2 tokens (a prompt token and a generated one), got {cfg.max_model_len}")
    if cfg.log_every <= 0:
        raise ConfigError(f"log_every: must be > 0 seconds, got {cfg.log_every}")
    if cfg.kv_cache_gb is not None and cfg.kv_cache_gb <= 0:
        raise ConfigError(f"kv_cache_gb: must be > 0, got {cfg.kv_cache_gb}")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise ConfigError(f"gpu_memory_utilization: must be in (0, 1], got {cfg.gpu_memory_utilization}")
    try:
        speculative_config(cfg.speculative, cfg.num_speculative_tokens, cfg.speculative_max_rows, cfg.draft_model)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.max_wait <= 0:
        raise ConfigError(f"max_wait: must be > 0 seconds, got {cfg.max_wait}")
    if cfg.drain_timeout < 0:
        raise ConfigError(f"drain_timeout: must be >= 0 seconds, got {cfg.drain_timeout}")
    _validate_lanes(cfg)
    try:
        cfg.sampling_defaults()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.shard is not None:
        from batchjob.sharding.shards import ShardSpec

        ShardSpec.resolve(cfg.shard)  # the one K/N parser; raises ConfigError naming the field
    return cfg


def _validate_task(cfg: JobConfig) -> None:
    if cfg.dimensions is not None and (isinstance(cfg.dimensions, bool) or not isinstance(cfg.dimensions, int)
                                        or cfg.dimensions < 1):
        raise ConfigError(f"dimensions: must be an integer >= 1, got {cfg.dimensions!r}")
    if cfg.task != Task.EMBED:
        given = [name for name, unset in (("pooling", cfg.pooling is None), ("dimensions", cfg.dimensions is None),
                                          ("embed_prefix", not cfg.embed_prefix),
                                          ("truncate", not cfg.truncate)) if not unset]
        if given:
            raise ConfigError(f"{given[0]}: applies to task = \"embed\" only (this job's task is {cfg.task}); "
                              "add --task embed")
    if cfg.task == Task.GENERATE:
        return
    clash = [name for name, on in (("chat", cfg.chat), ("logprobs", cfg.logprobs is not None), ("n", cfg.n != 1),
                                   ("speculative", cfg.speculative != SpeculativeMethod.NONE),
                                   ("prompt_logprobs", cfg.task == Task.EMBED and cfg.prompt_logprobs is not None),
                                   ("structured outputs", cfg.structured_outputs() is not None)) if on]
    if clash:
        raise ConfigError(f"{clash[0]}: not with task = \"{cfg.task}\" (its rows are one prefill each and generate "
                          "nothing; chat templates are not applied to them)")


def _validate_lanes(cfg: JobConfig) -> None:
    allowed = {"name", "priority", "weight", "input", "max_tokens"}
    names = set()
    for i, lane in enumerate(cfg.lanes):
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
    with_input = [lane.get("input") is not None for lane in cfg.lanes]
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


def _coerce(name: str, value):
    """A value as its option's type: a mode's text as its enum member, a flag's text as a list; anything else of
    the wrong type is a ConfigError naming the field."""
    if name == "max_errors":
        return _error_limit(value)
    if isinstance(value, tuple):  # a repeated flag (cli/run_options.py): each value read as one flag's, then joined
        return _joined(name, [_coerce(name, v) for v in value])
    members = scalar_types(name)
    if value is None:
        if type(None) not in members:
            raise ConfigError(f"{name}: a value is required")
        return None
    mode = mode_of(name)
    if mode is not None:
        return _mode(name, mode, value)
    base = next(t for t in members if t is not type(None))
    if base is bool and not isinstance(value, bool):
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if base is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{name}: expected {UNITS.get(name, 'an integer')}, got {value!r}")
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}: expected {UNITS.get(name, 'a number')}, got {value!r}")
        return float(value)
    if name == "lanes":
        if not isinstance(value, list):
            raise ConfigError("lanes: expected [[lanes]] tables")
        return value
    if OPTIONS[name].texts:
        return _texts(name, value)
    if name == "chat_template_kwargs":
        return template_kwargs(value, "chat_template_kwargs", ConfigError)
    if name == "adapters":
        return adapter_paths(value)
    if typing.get_origin(base) is list:  # a flag gives them comma-separated
        return _list(name, value, typing.get_args(base)[0])
    return value


def _joined(name: str, parts: list):
    """The values of a repeated flag as one: the lists end to end; the adapters' names together (one name given two
    paths is refused)."""
    if name != "adapters":
        return [item for part in parts for item in part]
    joined: dict[str, str] = {}
    for part in parts:
        for adapter, path in part.items():
            if joined.setdefault(adapter, path) != path:
                raise ConfigError(f"lora: adapter {adapter!r} is given twice, as {joined[adapter]} and {path}")
    return joined


def _mode(name: str, mode: type[Enum], value):
    try:
        return mode(value)
    except ValueError:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(m.value for m in mode)}") from None


def _texts(name: str, value) -> list[str]:
    if isinstance(value, str):  # a flag: one text, or a JSON list of them
        if value.lstrip().startswith("["):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConfigError(f"{name}: {value!r} is not a JSON list of strings ({e})") from None
        else:
            value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{name}: expected a string or a list of strings, got {value!r}")
    return list(value)


def _list(name: str, value, item: type) -> list:
    if name == "choice" and isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)  # a JSON list: choices that hold commas
        except ValueError as e:
            raise ConfigError(f"choice: {value!r} is not a JSON list of strings ({e})") from None
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{name}: expected a list, got {value!r}")
    try:
        return [item(v) for v in value]
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected a list of {'integers' if item is int else 'strings'}, got {value!r}") from None


RESERVED_TEMPLATE_KEYS = ("messages", "add_generation_prompt")  # set by batchjob for every row


def template_kwargs(value, where: str, error: type[Exception]) -> dict:
    """Chat template variables: a JSON object, or its text; `error(message)` names `where` when it is not one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise error(f"{where}: invalid JSON: {e}") from None
    if not isinstance(value, dict):
        raise error(f"{where}: expected an object of chat template variables, e.g. {{\"enable_thinking\": false}}, "
                    f"got {type(value).__name__}")
    taken = [k for k in value if k in RESERVED_TEMPLATE_KEYS]
    if taken:
        raise error(f"{where}: {taken[0]!r} is set by batchjob for every row; leave it out")
    return value


def adapter_paths(value) -> dict[str, str]:
    """`--lora NAME=PATH,...` or the job file's `[lora] adapters = {NAME = "PATH"}` -> {name: path}."""
    if isinstance(value, str):
        pairs = {}
        for item in (x.strip() for x in value.split(",") if x.strip()):
            name, eq, path = item.partition("=")
            if not eq or not name.strip() or not path.strip():
                raise ConfigError(f"lora: {item!r}: expected NAME=PATH (a PEFT adapter folder)")
            pairs[name.strip()] = path.strip()
        value = pairs
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in value.items()):
        raise ConfigError(f"lora adapters: expected {{NAME = \"PATH\", ...}}, got {value!r}")
    return dict(value)
