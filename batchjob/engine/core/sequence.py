"""A row inside the engine: its token ids, how many are cached, its block table, its sampling state."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from batchjob.engine.core.detokenizer import IncrementalDetokenizer
from batchjob.engine.params import ImageSlot, SamplingParams



class RowGrammar(Protocol):
    """What the core asks of a structured row's grammar (engine/structured/matcher.py's Matcher, which the structured
    rows set on the row): take each token the row keeps, say whether it is complete, and why it failed."""

    @property
    def error(self) -> str | None: ...

    def consume(self, token_ids: int) -> bool: ...

    def is_finished(self) -> bool: ...


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV copied to the host pool; waits to be swapped back in
    FINISHED = "finished"


@dataclass(slots=True, eq=False, weakref_slot=True)  # a proposer keeps its state of a row by a weak key
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    rng_key: int = 0  # derived from (job seed, row index): a row's random stream ignores its batch-mates
    lane: str = "default"
    priority: int = 0
    token_ids: list[int] = field(default_factory=list)  # the known ids: prompt, then output
    # tokens sampled by steps still running (async scheduling): counted in num_tokens, their ids not back yet
    num_placeholders: int = 0
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # chained digests of the full computed blocks
    arrival: int = 0  # admission order, for "youngest first" preemption
    enqueued_at: float = 0.0  # when the row entered the waiting queue (aging, wait statistics)
    first_scheduled_at: float | None = None
    reserved_blocks: int = 0  # admission=reserve: blocks set aside for the whole row
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0
    stop_token_set: frozenset[int] = frozenset()  # EOS (unless ignore_eos) + stop_token_ids; set by Engine.add
    detokenizer: IncrementalDetokenizer | None = None  # rows with stop strings (engine/core/detokenizer.py)
    logprobs: list | None = None  # params.logprobs set: one (token id, logprob, top [(id, logprob)]) per output token
    # params.prompt_logprobs set: one PromptLogprob per prompt position from the second, as its chunks compute
    prompt_logprobs: list | None = None
    draft: list[int] | None = None  # tokens proposed for this step (speculative decoding), verified by the next forward
    matcher: RowGrammar | None = None  # structured rows: the grammar's state (engine/structured/matcher.py)
    error: str | None = None  # finish_reason "error": why (a grammar that does not compile)
    embedding: list[float] | None = None  # embed rows, once finished: the pooled (and normalised) vector
    images: tuple[ImageSlot, ...] = ()  # images in the prompt, in order (a vision-language model's rows)
    lora: int = -1  # its LoRA adapter's slot (-1: the base model)
    prefix_root: bytes = b""  # the parent of its first block's prefix-cache key: an adapter's rows key their own prefixes

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_placeholders

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_output(self) -> int:
        return self.num_tokens - len(self.prompt_ids)
