"""The seam between the engine (its scheduler and output processing) and whatever runs its steps: the Executor.
In process today, the ModelRunner is one; an executor over several devices (tensor parallel workers, a process
per GPU) implements the same four things, and the engine does not change."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from batchjob.engine.core.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from batchjob.engine.worker.encoder import EncoderStats
    from batchjob.engine.worker.model_runner import StepTokens


class Executor(Protocol):
    model_s: float  # seconds spent inside the model so far (forward and logits), for the step statistics
    encoder: EncoderStats  # image placeholder runs encoded so far and the image encoder's seconds (within model_s)

    def run(self, out: SchedulerOutput, in_flight: StepTokens | None = None) -> StepTokens:
        """Take the step's differences into the rows it keeps, launch its forward and sampling; its tokens come back
        through the handle. `in_flight`: the step launched before it whose tokens are not back yet (async
        scheduling fills placeholders from it)."""

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> int:
        """Move KV blocks (device, host) out to the host pool and (host, device) back; the blocks moved."""

    def release(self, seq_ids: Iterable[int]) -> None:
        """Rows the engine is done with (finished, or taken back): the executor drops what it kept of them."""
