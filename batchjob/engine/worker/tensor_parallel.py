"""The Executor of a model split over tensor-parallel ranks (models/tensor_parallel.py): one scheduler, on rank 0,
drives every rank. Each step rank 0 broadcasts what its own ModelRunner is handed (the SchedulerOutput, with the
rows released and the KV blocks swapped since the last step), and every rank runs the same step on its slice:
the same forward, whose all-reduces and vocabulary gather meet across the ranks, over its own KV blocks (each
rank holds its heads' K/V; the block tables are the scheduler's, the same on every rank). Rank 0 samples; the
tokens reach the other ranks with the next step's rows, as any token the scheduler sends. One broadcast a step.

The other ranks run `serve` (engine/tensor_parallel.py starts them): a ModelRunner that does not sample, applying
what rank 0 sends until it sends Stop."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from batchjob.engine.core.scheduler_output import SchedulerOutput
from batchjob.errors import RankLostError
from batchjob.engine.worker.model_runner import ModelRunner, StepTokens
from batchjob.models.causal_lm import CausalLM


LOST_WAIT_S = 5.0  # after a failed collective, how long to wait for the rank's exit to show


@dataclass(frozen=True, slots=True)
class NewRunner:
    """Build a fresh ModelRunner (a new engine around the model: its KV cache and rows start empty)."""
    num_blocks: int
    block_size: int
    num_host_blocks: int
    encoder_cache_tokens: int


@dataclass(slots=True)
class StepMessage:
    """One step, in the order rank 0 applied it: rows released, KV blocks swapped, then the step run."""
    released: list[int] = field(default_factory=list)
    swaps: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = field(default_factory=list)
    out: SchedulerOutput | None = None


@dataclass(frozen=True, slots=True)
class Stop:
    """The job is done: the other ranks leave."""


def broadcast(message=None):
    """Rank 0 sends `message` to every rank; every other rank passes None and gets it."""
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class TensorParallelExecutor:
    """Rank 0's executor: its own ModelRunner, and every step sent to the other ranks first."""

    def __init__(self, model, num_blocks: int, block_size: int, num_host_blocks: int = 0, encoder_cache_tokens: int = 0):
        broadcast(NewRunner(num_blocks, block_size, num_host_blocks, encoder_cache_tokens))
        self.model = model
        self.runner = ModelRunner(model, num_blocks, block_size, num_host_blocks, encoder_cache_tokens=encoder_cache_tokens)
        self._pending = StepMessage()

    @property
    def model_s(self) -> float:
        return self.runner.model_s

    @property
    def encoder(self):
        return self.runner.encoder

    def run(self, out: SchedulerOutput, in_flight: StepTokens | None = None) -> StepTokens:
        message, self._pending = self._pending, StepMessage()
        message.out = replace(out, grammar=None)  # the mask is rank 0's (it samples), filled in its own thread
        try:
            broadcast(message)
            return self.runner.run(out, in_flight)
        except RuntimeError as e:  # torch.distributed's error when a rank's connection closes
            why = self.model.parallel.lost(LOST_WAIT_S) or f"a tensor-parallel rank is gone ({str(e).split('. ')[0]})"
            raise RankLostError(f"{why}; the job stops: what was committed stays, rerun the same command to "
                                "resume") from None

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> int:
        self._pending.swaps.append((list(swap_out), list(swap_in)))
        return self.runner.swap(swap_out, swap_in)

    def release(self, seq_ids: Iterable[int]) -> None:
        ids = list(seq_ids)
        self._pending.released.extend(ids)
        self.runner.release(ids)


def serve(build: Callable[[object], CausalLM]) -> None:
    """A rank other than 0: run what rank 0 sends, on this rank's slice of the model, until Stop. A message of no
    kind known here asks for a model: `build(message)` builds this rank's slice (engine/tensor_parallel.py)."""
    model = runner = None
    while True:
        message = broadcast()
        if isinstance(message, Stop):
            return
        if isinstance(message, NewRunner):
            runner = None  # the old KV cache goes first
            runner = ModelRunner(model, message.num_blocks, message.block_size, message.num_host_blocks,
                                 encoder_cache_tokens=message.encoder_cache_tokens, samples=False)
        elif isinstance(message, StepMessage):
            if message.released:
                runner.release(message.released)
            for swap_out, swap_in in message.swaps:
                runner.swap(swap_out, swap_in)
            runner.run(message.out)
        else:
            model = runner = None  # the old weights go before the new ones load
            model = build(message)
