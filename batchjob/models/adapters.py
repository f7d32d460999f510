"""LoRA adapters as a model takes them (lora/apply.py's AdapterSet is the one there is): a typed seam, so that
neither the decoder nor the engine holds an object of unknown kind. The model gets its adapters when it is built
(build_model's `adapters`) and hands them its projections then, once; a step's adapters come from the step's own
input (StepContext.adapter_ids) as a LoraStep the forward passes down to its layers: no state kept between steps,
no attribute set on the model from outside. The job never reads them back from the model: it knows the slots it
asked for (job/engine_setup.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class LoraStep:
    """One step's adapters, made by the model's forward from its StepContext: each token's slot and their one-hot."""
    slots: torch.Tensor  # int32 [T], -1: the base model
    keep: torch.Tensor  # [T, slots] in the compute dtype: a token's own slot 1, the others (and the base's) 0


class ModelAdapters(Protocol):
    @property
    def digests(self) -> list[str]:
        """Per slot, its adapter's content digest: the engine keys each adapter's rows' prefix cache apart."""
        ...

    def put_on(self, model) -> None:
        """Give the model's projections (its layers' `*_lora` fields) every slot's weights; the model calls it once,
        while it is built. Raises for an adapter that does not fit the model."""
        ...

    def step(self, adapter_ids: torch.Tensor, dtype: torch.dtype) -> LoraStep:
        """A step's LoraStep from each token's slot (int32 [T], -1: the base model)."""
        ...


def adapted(ops, x: torch.Tensor, y: torch.Tensor, weights, lora: LoraStep | None) -> torch.Tensor:
    """A projection's output `y` (for input `x`) with its tokens' adapter deltas added, computed by the kernel set
    (KernelSet.lora); `y` as it is where the projection has no adapters or the step none."""
    if lora is None or weights is None:
        return y
    return ops.lora(x, y, weights, lora.slots, lora.keep)
