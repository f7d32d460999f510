"""A row inside the engine: its token ids, how many are cached, its block table, its sampling state."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV copied to the host pool; waits to be swapped back in
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    rng_key: int = 0  # derived from (job seed, row index): a row's random stream ignores its batch-mates
    lane: str = "default"
    priority: int = 0
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full computed blocks
    arrival: int = 0  # admission order, for "youngest first" preemption
    enqueued_at: float = 0.0  # when the row entered the waiting queue (aging, wait statistics)
    first_scheduled_at: float | None = None
    reserved_blocks: int = 0  # admission=reserve: blocks set aside for the whole row
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)
