"""A model family's interface to the registry: how it reads its config, names its weights and builds its
layers (ModelParts), without the registry knowing its code."""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from batchjob.kernels import RotaryEmbedding
from batchjob.models.config import ModelConfig
from batchjob.models.layers import DecoderLayer


@dataclass(slots=True)
class ModelParts:
    """What a family builds from HF-named weights (on the model's device and dtype already)."""
    layers: list[DecoderLayer]
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    rotaries: list[RotaryEmbedding]


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # as the docs list it
    hf_architectures: dict[str, str]  # HF `architectures` entry -> the variant (ModelConfig.architecture)
    model_types: dict[str, str]  # HF `model_type` -> the variant, when `architectures` names none of ours
    parse_hf: Callable[[dict, str, str], ModelConfig]  # (config.json, variant, source) -> ModelConfig
    weight_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]  # every HF weight name the config implies
    build: Callable[[ModelConfig, dict[str, torch.Tensor], torch.dtype, torch.device], ModelParts]
    gguf_architectures: dict[str, str] = field(default_factory=dict)  # GGUF general.architecture -> the variant
    parse_gguf: Callable[[dict, Collection[str], str, str], ModelConfig] | None = None
