"""JobConfig: one typed object built from the job file (TOML) plus CLI flags, validated once here."""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    pass


@dataclass(slots=True)
class JobConfig:
    # what to run
    model: str = "smollm2"  # "smollm2" (embedded GGUF) or a path: HF folder or .gguf file
    input: str = ""
    output: str = ""  # default: out/<job file name>
    input_format: str | None = None
    prompt_column: str = "prompt"
    messages_column: str = "messages"  # used when the input has this column
    chat: bool = False  # wrap a plain prompt as a user message and apply the chat template
    chat_template: str | None = None  # a file overriding the model's template
    system_prompt: str | None = None
    keep_columns: list[str] = field(default_factory=list)
    # sampling
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # engine
    dtype: str | None = None  # float32 | bfloat16 | float16; default: measured choice for the device
    device: str | None = None  # cpu | cuda; default cuda when available
    scheduling: str = "continuous"  # continuous | static
    batch_size: int = 16  # static batching's batch size
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    prefill_chunk: int = 0
    block_size: int = 16
    kv_cache_gb: float = 1.0
    threads: int = 0  # 0 = torch's default (all cores)
    # scheduler (see README "Scheduling knobs")
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
    progress: bool = True

    def validate(self) -> "JobConfig":
        if not self.input and not self.per_lane_inputs:
            raise ConfigError("input: no input given; set `input = \"PATH\"` in the job file or pass --input PATH")
        _choice("scheduling", self.scheduling, ("continuous", "static"))
        if self.dtype is not None:
            _choice("dtype", self.dtype, ("float32", "bfloat16", "float16"))
        if self.device is not None:
            _choice("device", self.device, ("cpu", "cuda"))
        for name in ("max_tokens", "max_num_seqs", "max_num_batched_tokens", "block_size", "batch_size", "part_rows"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ConfigError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.prefill_chunk < 0:
            raise ConfigError("top_k and prefill_chunk must be >= 0")
        if self.kv_cache_gb <= 0:
            raise ConfigError(f"kv_cache_gb: must be > 0, got {self.kv_cache_gb}")
        _choice("admission", self.admission, ("optimistic", "reserve"))
        _choice("preemption", self.preemption, ("auto", "recompute", "swap"))
        if self.max_wait <= 0:
            raise ConfigError(f"max_wait: must be > 0 seconds, got {self.max_wait}")
        self._validate_lanes()
        return self

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


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(allowed)}")


FIELDS = {f.name: f for f in dataclasses.fields(JobConfig)}
SECTIONS = ("sampling", "engine", "output", "job")  # optional TOML tables; their keys are fields too


def load_job(path: str | Path | None, overrides: dict) -> JobConfig:
    """Job file values, then every non-None override; relative paths in the file are taken from the cwd."""
    values: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"job file {p} not found")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
        for key, value in data.items():
            if key in SECTIONS and isinstance(value, dict):
                for k, v in value.items():
                    values[_field(p, f"{key}.{k}", k)] = v
            else:
                values[_field(p, key, key)] = value
        values.setdefault("output", str(Path("out") / p.stem))
    values.update({k: v for k, v in overrides.items() if v is not None})
    if not values.get("output"):
        values["output"] = str(Path("out") / (Path(values.get("input") or "job").stem or "job"))
    cfg = JobConfig()
    for k, v in values.items():
        setattr(cfg, k, _coerce(k, v))
    return cfg.validate()


def _field(path: Path, shown: str, key: str) -> str:
    if key not in FIELDS:
        raise ConfigError(f"{path}: unknown field {shown!r}; known fields: {', '.join(sorted(FIELDS))}")
    return key


def _coerce(name: str, value):
    default = FIELDS[name].default
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
    if name in ("keep_columns", "stop_token_ids"):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return [int(v) for v in value] if name == "stop_token_ids" else [str(v) for v in value]
    return value
