"""What the worker keeps of each row between steps (vLLM v1's persistent per-request state, in its small form):
the sampler's penalty counts and the pooler's running sum, device tensors that belong with the worker rather
than on the engine's Sequence. A row's state is made the first step that needs it and dropped when the engine
releases the row (Executor.release: it finished); a preempted row keeps its state (its tokens stay the same)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RowState:
    penalties: object | None = None  # engine/sample/sampler.py PenaltyState (the sampler owns its shape)
    pooled: torch.Tensor | None = None  # embed rows: the pooling over the chunks computed so far (pooler.py)


class RowStates:
    def __init__(self) -> None:
        self._rows: dict[int, RowState] = {}

    def of(self, seq_id: int) -> RowState:
        state = self._rows.get(seq_id)
        if state is None:
            state = self._rows[seq_id] = RowState()
        return state

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._rows.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._rows)
