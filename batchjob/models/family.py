"""A model family's interface to the registry: how it reads its config, names its weights and builds its
layers (ModelParts), without the registry knowing its code."""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

import torch

from batchjob.kernels import RotaryEmbedding
from batchjob.kernels.linear_quant import PackedWeight
from batchjob.kernels.quantization import MatmulFormat
from batchjob.models.config import ModelConfig
from batchjob.models.layers import DecoderLayer
from batchjob.models.step_context import DECODER_FEATURES, ModelFeature


@dataclass(slots=True)
class ModelParts:
    """What a family builds from HF-named weights (on the model's device and dtype already)."""
    layers: list[DecoderLayer]
    embed: torch.Tensor | PackedWeight  # packed: a GGUF file's embeddings, looked up as stored
    final_norm: torch.Tensor
    lm_head: torch.Tensor | PackedWeight
    rotaries: list[RotaryEmbedding]
    # a vision-language family's image encoder: pixel values [B, 3, S, S] -> [B, tokens per image, hidden]
    image_encoder: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True, slots=True)
class BuildSpec:
    """What a family builds its layers with: the compute dtype, the device and the weight matmuls' format, all
    given explicitly (a family passes `matmuls` to every `linear`)."""
    dtype: torch.dtype
    device: torch.device
    matmuls: MatmulFormat


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # as the docs list it
    hf_architectures: dict[str, str]  # HF `architectures` entry -> the variant (ModelConfig.architecture)
    model_types: dict[str, str]  # HF `model_type` -> the variant, when `architectures` names none of ours
    parse_hf: Callable[[dict, str, str], ModelConfig]  # (config.json, variant, source) -> ModelConfig
    weight_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]  # every HF weight name the config implies
    build: Callable[[ModelConfig, dict[str, torch.Tensor], BuildSpec], ModelParts]
    # what a step may carry into this family's forward besides token ids (models/step_context.py)
    features: frozenset[ModelFeature] = DECODER_FEATURES
    # GGUF (llama.cpp's format): what its convert_hf_to_gguf.py wrote for this family, and how to read it back
    gguf_architectures: dict[str, str] = field(default_factory=dict)  # GGUF general.architecture -> the variant
    # (metadata, tensor names, variant, source); None: a file of that GGUF architecture that is another family's
    parse_gguf: Callable[[dict, Collection[str], str, str], ModelConfig | None] | None = None
    # llama.cpp's tensor name (gguf.constants.TENSOR_NAMES spelling, no .weight/.bias) -> ours, per config:
    # "blk.{bid}.attn_q" -> "model.layers.{bid}.self_attn.q_proj". A target with {xid} is a 3-D stack of experts
    # (llama.cpp's *_exps), split along its first dim into one HF weight per expert.
    gguf_names: Callable[[ModelConfig], dict[str, str]] | None = None
    # undoes what the converter did to one tensor's values, given its HF name (llama's Q/K row permute, Gemma's
    # norms stored as 1 + w); vectors (norms, biases) arrive in float32, matrices in the load dtype
    gguf_tensor: Callable[[ModelConfig, str, torch.Tensor], torch.Tensor] | None = None
    # a checkpoint's weight name -> the one weight_shapes uses, where checkpoints of the family name weights
    # several ways (LLaVA: llava-hf's on the Hub, transformers 4's and 5's saves); None: as stored
    canonical_name: Callable[[str], str] | None = None


def prefix_renamer(renames: tuple[tuple[str, str], ...]) -> Callable[[str], str]:
    """A Family.canonical_name from (checkpoint prefix, ours) pairs: the first prefix a name starts with is replaced;
    a name no prefix matches is kept."""
    def canonical_name(name: str) -> str:
        for old, new in renames:
            if name.startswith(old):
                return new + name[len(old):]
        return name
    return canonical_name


@dataclass(frozen=True, slots=True)
class VisionLanguage:
    """A vision-language family's weights and build: a text family's model (its config's architecture renamed to
    `text_architecture`) with an image encoder on it. The encoder is built first: it takes the vision weights out of
    w (a text build may fold every weight it sees, e.g. Gemma's norms)."""
    text_architecture: str
    text_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]  # the text family's weight_shapes
    text_build: Callable[[ModelConfig, dict[str, torch.Tensor], BuildSpec], ModelParts]  # its build
    vision_config: Callable[[ModelConfig], object]  # the family's vision config (with its weight_shapes())
    encoder: Callable[..., Callable[[torch.Tensor], torch.Tensor]]  # (vision config, w, dtype, device) -> encoder

    def text(self, c: ModelConfig) -> ModelConfig:
        return replace(c, architecture=self.text_architecture)

    def weight_shapes(self, c: ModelConfig) -> dict[str, tuple[int, ...]]:
        return self.text_shapes(self.text(c)) | self.vision_config(c).weight_shapes()

    def build(self, c: ModelConfig, w: dict[str, torch.Tensor], spec: BuildSpec) -> ModelParts:
        encoder = self.encoder(self.vision_config(c), w, spec.dtype, spec.device)
        return replace(self.text_build(self.text(c), w, spec), image_encoder=encoder)
