"""What a model asks of the adapters put on its matmuls, and what the engine reads of them (lora/apply.py's
AdapterSet is the one there is): a typed seam, so that neither the decoder nor the engine holds an object of unknown
kind. The job never reads them back from the model: it knows the slots it asked for (job/engine_setup.py)."""
from __future__ import annotations

from typing import Protocol

import torch

from batchjob.kernels import KernelSet


class ModelAdapters(Protocol):
    @property
    def digests(self) -> list[str]:
        """Per slot, its adapter's content digest: the engine keys each adapter's rows' prefix cache apart."""
        ...

    def begin(self, adapter_ids: torch.Tensor | None, dtype: torch.dtype, ops: KernelSet) -> None:
        """A step starts: each token's slot (int32 [T], -1: the base model; None: no adapter in the step), the
        compute dtype, and the kernel set that computes the deltas."""
        ...
