"""A PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`), read and checked against the base
model: what PEFT features it uses (`r`, `lora_alpha`, `use_rslora`, `target_modules`, `layers_to_transform`) and
refusals, each naming the adapter and the field, for what batchjob does not apply (DoRA, `modules_to_save`, biases,
embedding or LM-head targets, a rank over --max-lora-rank, shapes that do not fit the base). Weights only from
safetensors."""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from batchjob.errors import ConfigError, ModelLoadError
from batchjob.models.location import hf_cache_snapshot, hf_id

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# the projections of the families we run, by PEFT's module names (Phi-3 names its fused ones qkv_proj, gate_up_proj)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
NOT_APPLIED = ("embed_tokens", "lm_head")
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraError(ConfigError):
    """An adapter batchjob cannot apply: the message names the adapter and the field."""


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    path: str
    rank: int
    scale: float  # lora_alpha / r, or / sqrt(r) with rsLoRA: folded into B
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A [r, in], B [out, r])
    digest: str  # SHA-256 over the config and the weights file: the job's fingerprint and the prefix cache's key

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}


def read_adapter(name: str, path: str | Path, max_rank: int | None = None) -> LoraAdapter:
    """The adapter at `path` (a PEFT folder) under `name`; LoraError says what cannot be applied."""
    folder = Path(path)
    where = f"lora {name!r} ({folder})"
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise LoraError(f"{where}: a PEFT adapter folder needs {CONFIG} and {WEIGHTS} (weights are read from "
                        "safetensors only)")
    cfg = json.loads((folder / CONFIG).read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{where}: peft_type {cfg.get('peft_type')!r}: only LORA adapters are supported")
    for field, bad, why in (("use_dora", lambda v: bool(v), "DoRA"), ("modules_to_save", lambda v: bool(v), "modules_to_save"),
                            ("bias", lambda v: v not in (None, "none"), "LoRA biases"),
                            ("rank_pattern", lambda v: bool(v), "per-module ranks"),
                            ("alpha_pattern", lambda v: bool(v), "per-module alphas")):
        if bad(cfg.get(field)):
            raise LoraError(f"{where}: {field} = {json.dumps(cfg.get(field))}: {why} is not supported")
    rank, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    if max_rank is not None and rank > max_rank:
        raise LoraError(f"{where}: r = {rank} is over --max-lora-rank {max_rank}")
    targets = cfg.get("target_modules") or []
    named = [targets] if isinstance(targets, str) else list(targets)
    for t in named:
        if any(part in t for part in NOT_APPLIED):
            raise LoraError(f"{where}: target_modules {json.dumps(targets)}: {t!r} targets embeddings or the LM head, "
                            "which are not supported")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    layers = cfg.get("layers_to_transform")
    keep = None if layers is None else set([layers] if isinstance(layers, int) else layers)
    raw = load_file(str(folder / WEIGHTS))
    weights: dict[tuple[int, str], list] = {}
    for key, tensor in raw.items():
        m = _KEY.match(key)
        if m is None:
            raise LoraError(f"{where}: weight {key!r} is not a LoRA A/B matrix of a decoder layer's projection "
                            "(embeddings, LM head, experts and other modules are not supported)")
        layer, module, which = int(m[1]), m[2], m[3]
        if module not in MODULES:
            raise LoraError(f"{where}: target module {module!r} is not supported ({', '.join(MODULES)})")
        if keep is not None and layer not in keep:
            continue
        pair = weights.setdefault((layer, module), [None, None])
        pair[0 if which == "A" else 1] = tensor.float()
    for (layer, module), (a, b) in weights.items():
        if a is None or b is None or a.shape[0] != rank or b.shape[1] != rank:
            raise LoraError(f"{where}: layer {layer} {module}: lora_A and lora_B of rank {rank} are needed")
    digest = hashlib.sha256((folder / CONFIG).read_bytes() + (folder / WEIGHTS).read_bytes()).hexdigest()
    return LoraAdapter(name, str(folder), rank, scale, {k: (a, b) for k, (a, b) in weights.items()}, digest)


def read_adapters(paths: dict[str, str], max_rank: int | None = None) -> list[LoraAdapter]:
    """The job's adapters, in the order given (slot i = the i-th)."""
    return [read_adapter(name, adapter_folder(name, path), max_rank) for name, path in paths.items()]


def adapter_folder(name: str, path: str) -> Path:
    """The folder of adapter `name`: `path`, or an org/name[@revision] snapshot in the local Hugging Face cache
    (models/location.py) holding adapter_config.json; LoraError says what an adapter folder holds when it is not
    there (not what a model folder holds)."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    where, holds = f"lora {name!r}: {path}", f"an adapter is a PEFT folder holding {CONFIG} and {WEIGHTS}"
    if folder.exists():
        raise LoraError(f"{where}: a file, not a folder; {holds}")
    named = hf_id(path)
    if named is None:
        raise LoraError(f"{where}: no such folder; {holds} (or name an org/name in the local Hugging Face cache)")
    try:
        return hf_cache_snapshot(*named, needs=CONFIG)
    except ModelLoadError as e:
        raise LoraError(f"{where}: no such folder, nor in the local Hugging Face cache ({e}); {holds}") from None
