"""Scheduler: one token-budget loop per step. No prefill phase, no decode phase: every row has
`num_tokens` and `num_computed`, and the step gives each row the next slice of its tokens.
Running rows come first (their decode token, or the next chunk of their prompt), then waiting rows
are admitted while the budget, the slot count and the KV pool allow. The scheduler moves block ids,
never tensors."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchjob.engine.block_pool import BlockPool
from batchjob.engine.sequence import Sequence, SeqStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    prefill_chunk: int = 0  # 0 = a row's prompt chunk is limited only by the budget
    static_batch: int = 0  # > 0: classic static batching with batches of this size
    watermark_blocks: int = 1  # admission keeps this many blocks free for running rows to grow


@dataclass(slots=True)
class Step:
    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens of each row computed in this step
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._arrivals = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_tokens - seq.num_computed, budget)
        if self.config.prefill_chunk:
            n = min(n, self.config.prefill_chunk)
        return n

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.pool.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the row's cache; it re-prefills prompt + generated tokens later."""
        self.running.remove(seq)
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def schedule(self) -> Step:
        cfg = self.config
        step = Step()
        budget = cfg.max_num_batched_tokens
        scheduled: set[int] = set()
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(seq, budget)
            while not self._grow(seq, seq.num_computed + n):
                victim = next((s for s in reversed(self.running) if id(s) not in scheduled), None)
                if victim is None or victim is seq:
                    break
                self._preempt(victim)
                step.preempted.append(victim)
            else:
                step.seqs.append(seq)
                step.num_new.append(n)
                scheduled.add(id(seq))
                budget -= n
                continue
            self._preempt(seq)  # nothing younger to evict: this row waits for blocks
            step.preempted.append(seq)

        admit = not cfg.static_batch or not self.running
        max_seqs = cfg.static_batch or cfg.max_num_seqs
        while admit and self.waiting and budget > 0 and len(self.running) < max_seqs:
            seq = self.waiting[0]
            # admit only if the whole prompt (+1 generated token) fits beside the watermark
            need = self.pool.blocks_for(seq.num_tokens + 1) + cfg.watermark_blocks
            if need > self.pool.num_free:
                break
            n = self._chunk(seq, budget)
            self._grow(seq, seq.num_computed + n)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.arrival = self._arrivals
            self._arrivals += 1
            self.running.append(seq)
            step.seqs.append(seq)
            step.num_new.append(n)
            budget -= n
        return step

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        self.pool.release(seq.block_table)
        seq.block_table = []
