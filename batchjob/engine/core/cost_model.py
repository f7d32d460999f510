"""preemption=auto's cost model: recomputing a row costs its tokens over the measured prefill rate,
swapping it costs its KV bytes (out and back) over the measured copy rate."""
from __future__ import annotations

from batchjob.engine.core.sequence import Sequence


class CostModel:
    """preemption=auto: recompute costs tokens / prefill rate, swap costs bytes (out and back) / copy rate.
    Both rates are measured as the engine runs (exponential averages), starting from rough guesses."""

    def __init__(self, bytes_per_block: int):
        self.bytes_per_block = bytes_per_block
        self.tokens_per_s = 2000.0
        self.bytes_per_s = 4e9

    def observe_forward(self, tokens: int, seconds: float) -> None:
        if tokens >= 32 and seconds > 0:
            self.tokens_per_s = 0.8 * self.tokens_per_s + 0.2 * tokens / seconds

    def observe_swap(self, nbytes: int, seconds: float) -> None:
        if nbytes and seconds > 0:
            self.bytes_per_s = 0.8 * self.bytes_per_s + 0.2 * nbytes / seconds

    def prefer_swap(self, seq: Sequence) -> bool:
        recompute = seq.num_computed / self.tokens_per_s
        swap = 2 * len(seq.block_table) * self.bytes_per_block / self.bytes_per_s
        return swap < recompute
