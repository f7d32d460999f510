"""What one forward reads, as one typed object: the step's tokens (their ids, or the input embeddings a feature
computed for them), their positions, the paged-attention metadata and KV caches, and per-token adapter slots.
The engine's runner builds it (engine/worker/); the model reads only it. A family declares the features it
takes (`ModelFeature`); a step that asks for one the model lacks is refused by name, never run half-way."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from batchjob.kernels import AttentionMetadata
from batchjob.models.config import UnsupportedModelError


class ModelFeature(enum.StrEnum):
    """What a step may carry besides token ids and 1-D positions (vLLM's SupportsMultiModal / SupportsLoRA)."""
    INPUT_EMBEDS = "input embeddings"  # a token's embedding given instead of looked up (images, soft prompts)
    MROPE = "3-D positions (M-RoPE)"  # (temporal, height, width) positions for image and video tokens
    LORA = "LoRA adapters"  # per-token adapter slots, added beside the base weight matmuls


# what every DecoderLM's forward takes besides token ids (models/decoder.py): a family declares more
DECODER_FEATURES = frozenset({ModelFeature.INPUT_EMBEDS})


@dataclass(slots=True)
class StepContext:
    positions: torch.Tensor  # int64 [T], or [3, T] for a family with MROPE
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), the kernel set's layout
    input_ids: torch.Tensor | None = None  # int64 [T]; where inputs_embeds is given, it wins
    # [T, hidden] in the model's dtype, NaN-free: the embedding of each token, computed by a feature (an image's
    # encoder output at its placeholder tokens, the looked-up embedding elsewhere); None: looked up from input_ids
    inputs_embeds: torch.Tensor | None = None
    adapter_ids: torch.Tensor | None = None  # int32 [T]: each token's LoRA slot (-1: the base model)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[-1]

    def features(self) -> frozenset[ModelFeature]:
        """The features this step uses."""
        used = set()
        if self.inputs_embeds is not None:
            used.add(ModelFeature.INPUT_EMBEDS)
        if self.positions.dim() == 2:
            used.add(ModelFeature.MROPE)
        if self.adapter_ids is not None:
            used.add(ModelFeature.LORA)
        return frozenset(used)

    def check(self, supported: frozenset[ModelFeature], model: str) -> None:
        """Raises UnsupportedModelError naming the first feature the step uses that `model` does not take."""
        missing = sorted(self.features() - supported)
        if missing:
            raise UnsupportedModelError(f"{model}: {missing[0]} are not supported by this model family")
        if self.input_ids is None and self.inputs_embeds is None:
            raise ValueError("a step needs input_ids or inputs_embeds")
