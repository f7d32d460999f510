"""CausalLM: what the engine, the runner, the job and the bench use of a model, whatever its family."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from batchjob.kernels import KernelSet
from batchjob.models.adapters import ModelAdapters
from batchjob.models.config import ModelConfig
from batchjob.models.tensor_parallel import RankGroup
from batchjob.models.step_context import ModelFeature, StepContext


class CausalLM(Protocol):
    config: ModelConfig  # sizes the KV cache needs per layer: num_layers, num_kv_heads, head_dim
    dtype: torch.dtype
    device: torch.device
    kernels: KernelSet  # the kernel set chosen at load (kernels/dispatch.py)
    kv_cache_dtype: str  # auto | int8 | int4
    quantization: str  # the weight matmuls: none | int8 | fp8 (kernels/quantization.py)

    def fit_kernels(self, block_size: int) -> None: ...

    def fit_context(self, max_model_len: int) -> None:
        """What depends on the job's context length (Phi-3 longrope: which factors); before the first step."""

    features: frozenset[ModelFeature]  # what a step may carry besides token ids (the family's declaration)

    def forward(self, step: StepContext) -> torch.Tensor:
        """The final hidden states [T, hidden] of the step's tokens (models/step_context.py)."""

    def raw_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    # a vision-language family's image encoder: pixel values [B, 3, S, S] -> [B, tokens per image, hidden]; else None
    image_encoder: Callable[[torch.Tensor], torch.Tensor] | None
    adapters: ModelAdapters | None  # the LoRA adapters it was built with (build_model), or None
    parallel: RankGroup | None  # one tensor-parallel rank's slice of the model (models/tensor_parallel.py), or None

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids' input embeddings, as the forward looks them up (a step's inputs_embeds start from these)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def weight_memory(self) -> dict[str, int]:
        """Bytes the weights hold in memory per format ("Q4_K", "int8", "bfloat16", ...), for the start line."""
