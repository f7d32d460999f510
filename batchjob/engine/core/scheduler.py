"""Scheduler: one token-budget loop per step. No prefill phase, no decode phase: every row has
`num_tokens` and `num_computed`, and a step gives each row the next slice of its tokens — running
rows' decode tokens first, then running rows' prompt chunks, then waiting rows admitted by lane.

Which lane admits next lives in engine/core/lanes.py; here: whether a row fits (admission, optimistic or
reserving), and which running row gives way (preemption, by recompute or swap, its budget refunded).
The scheduler moves block ids, never tensors."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable

from batchjob.engine.core.block_pool import BlockPool, block_hashes
from batchjob.engine.core.encoder_budget import EncoderBudget
from batchjob.engine.core.lanes import Lane, LaneQueues, admit_order, victim_order
from batchjob.engine.core.sequence import Sequence, SeqStatus
from batchjob.engine.params import Refusal, RefusalCode, invalid

__all__ = ["Lane", "Scheduler", "SchedulerConfig", "Step"]  # Lane: re-exported for callers that configure lanes


class Admission(StrEnum):
    """When a waiting row may start: its prompt plus a watermark fits (optimistic, relies on preemption), or
    its prompt plus max_tokens (reserve: never preempts)."""
    OPTIMISTIC = "optimistic"
    RESERVE = "reserve"


class Preemption(StrEnum):
    """How a running row gives way: auto (by the engine's cost model; else recompute), recompute or swap."""
    AUTO = "auto"
    RECOMPUTE = "recompute"
    SWAP = "swap"


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    prefill_chunk: int = 0  # 0 = a row's prompt chunk is limited only by the budget
    static_batch: int = 0  # > 0: classic static batching with batches of this size
    admission: Admission = Admission.OPTIMISTIC
    preemption: Preemption = Preemption.AUTO
    watermark_blocks: int = 1
    max_wait: float = 300.0  # seconds; a row waiting longer goes ahead of every lane
    aging: float = 0.0  # priority points gained per second of waiting; 0 = reach the top lane at max_wait
    max_model_len: int = 1 << 30  # capped further by the model's context and the KV pool (Scheduler.max_model_len)
    lanes: list[Lane] = field(default_factory=lambda: [Lane()])
    max_loras: int = 8  # distinct LoRA adapters in one step (vLLM's max_loras); rows of another wait a step
    # image placeholder rows a step may send to the image encoder (engine/core/encoder_budget.py); 0: the step's
    # token budget (vLLM's default); cached images cost nothing
    max_num_encoder_tokens: int = 0


@dataclass(slots=True)
class Step:
    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens of each row computed in this step
    encoder_cost: list[int] = field(default_factory=list)  # image placeholder rows each row's chunk encodes
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    prefix_hit_tokens: int = 0
    encoder_budget: int = 0  # image placeholder rows the step may still encode
    encoder_tokens: int = 0  # image placeholder rows the step encodes (cached images not counted)
    prefix_query_tokens: int = 0
    token_budget: int = 0  # tokens not yet given to a row while the step is scheduled
    loras: set[int] = field(default_factory=set)  # the LoRA adapter slots of the step's rows

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, host_pool: BlockPool | None = None,
                 clock: Callable[[], float] = time.monotonic, prefer_swap: Callable[[Sequence], bool] | None = None,
                 context_len: int | None = None, encoder_cache_tokens: int = 0):
        """`context_len`: the model's context (max position embeddings); `encoder_cache_tokens`: the capacity of
        the worker's encoder cache (engine/worker/encoder.py); `config` is read, never changed."""
        self.config = config
        self.encoder = EncoderBudget(config.max_num_encoder_tokens or config.max_num_batched_tokens,
                                     encoder_cache_tokens)
        # a row can never hold more KV than the pool: it ends with "length" there instead of thrashing
        caps = {"max_model_len": config.max_model_len, "context": context_len or config.max_model_len,
                "kv": (pool.num_blocks - config.watermark_blocks) * pool.block_size}
        self.context_cap = min(caps, key=caps.get)  # which one sets it (the first of equals): for never_fits
        self.max_model_len = caps[self.context_cap]
        self.pool = pool
        self.host_pool = host_pool
        self.clock = clock
        self.prefer_swap = prefer_swap  # preemption=auto: cost model supplied by the engine
        self.queues = LaneQueues(config.lanes, config.max_wait, config.aging, clock)
        self.waiting = self.queues.waiting  # lane name -> its waiting rows, oldest first
        self.running: list[Sequence] = []
        self._arrivals = 0
        self._host_to_free: list[int] = []

    # queue

    def add(self, seq: Sequence) -> None:
        self.queues.add(seq, self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.queues)

    @property
    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def drop_waiting(self) -> list[Sequence]:
        """Take back the waiting rows that never started (a stopping job lets only started rows finish)."""
        return self.queues.drop_unstarted()

    def never_fits(self, seq: Sequence) -> Refusal | None:
        """Why a row can never be admitted (a per-row error), or None."""
        n, limit = seq.num_prompt, self.max_model_len
        if n == 0:
            return invalid("empty prompt: it has no tokens")
        too_long = RefusalCode.CONTEXT_LENGTH_EXCEEDED
        if seq.params.prefill_only:  # an embed or scoring row generates nothing: its prompt alone must fit
            if n > limit:
                return Refusal(too_long, f"prompt has {n} tokens; at most {limit} fit ({self._cap_why(limit)})")
            return None
        if n + 1 > limit:
            return Refusal(too_long, f"prompt has {n} tokens; at most {limit - 1} fit ({self._cap_why(limit)}; "
                                     "prompt + 1 generated token must fit)")
        return self._run_too_long(seq)

    def _run_too_long(self, seq: Sequence) -> Refusal | None:
        """Why an image run that must be computed in one step (bidirectional) never fits a step's token budget."""
        budget = self.config.max_num_batched_tokens
        for k, img in enumerate(seq.images):
            if img.bidirectional and img.length > budget:
                return invalid(f"image {k} is {img.length} tokens that attend to each other and must be computed in one "
                               f"step; max_num_batched_tokens is {budget}: raise it to at least {img.length}")
        return None

    def _cap_why(self, limit: int) -> str:
        return {"max_model_len": f"the context is capped at max_model_len {limit}",
                "context": f"the model's context is {limit} tokens",
                "kv": f"the KV cache holds {self.pool.num_blocks * self.pool.block_size} tokens"}[self.context_cap]

    # the step

    def schedule(self) -> Step:
        cfg = self.config
        if self._host_to_free:  # host blocks read by last step's swap-ins are free only now
            self.host_pool.release(self._host_to_free)
            self._host_to_free = []
        step = Step(token_budget=cfg.max_num_batched_tokens, encoder_budget=self.encoder.tokens_per_step)
        order = sorted(self.running, key=admit_order)
        decoding = [s for s in order if s.num_tokens - s.num_computed == 1]
        prefilling = [s for s in order if s.num_tokens - s.num_computed > 1]
        max_len = self.max_model_len
        for seq in decoding + prefilling:
            if step.token_budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not seq.params.prefill_only and (seq.num_output >= seq.params.max_tokens or seq.num_tokens >= max_len):
                continue  # its last token (a step in flight is sampling it) ends it: nothing to compute
            n, cost = self._encoder_cut(seq, self._chunk(seq, step.token_budget), step)
            if n == 0 or not self._lora_fits(seq, step):
                continue  # an image run that must go whole, or that the encoder has no room for, waits for a step
                # with room for it; so does an adapter
            if seq.draft and n == 1:  # speculative proposals: only into free budget and free blocks
                k = min(len(seq.draft), step.token_budget - 1)
                if k > 0 and self._grow(seq, seq.num_computed + 1 + k):
                    seq.draft = seq.draft[:k]
                    self._schedule(step, seq, 1 + k)
                    continue
                seq.draft = None
            if self._make_room(seq, seq.num_computed + n, step):
                self._schedule(step, seq, n, cost)

        admit = not cfg.static_batch or not self.running
        max_seqs = cfg.static_batch or cfg.max_num_seqs
        while admit and step.token_budget > 0:
            seq = self.queues.head()
            if seq is None or seq.num_placeholders:  # preempted while a step in flight samples
                break  # its last token: it comes back (recomputed or swapped in) once that token is known
            if len(self.running) >= max_seqs and not self._evict_lower(seq, step, slots=True):
                break
            if not self._lora_fits(seq, step):
                break  # the step has max_loras adapters already: the head waits for the next step
            if not self._admit(seq, step):  # may preempt rows scheduled above: their tokens come back
                break
            n, cost = self._encoder_cut(seq, self._chunk(seq, step.token_budget), step)
            if n == 0:
                break  # admitted; its first chunk (a whole image run, an image to encode) waits for the next step
            self._grow(seq, seq.num_computed + n)  # fits: admission counted the whole row
            self._schedule(step, seq, n, cost)
        return step

    def advance(self, step: Step) -> None:
        """At launch: the step's tokens count as computed (the next schedule() plans from there, even while
        the step still runs on the device)."""
        for seq, n in zip(step.seqs, step.num_new):
            seq.num_computed += n

    def publish(self, step: Step) -> None:
        """Once the step's tokens are known: its rows' newly full blocks go to the prefix cache. Rows
        preempted or finished since the launch (async scheduling) are skipped."""
        for seq in step.seqs:
            if seq.status is SeqStatus.RUNNING:
                self.pool.publish(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """`seq` is done: its blocks go back. It may have been preempted after the step that finished it
        was launched (async scheduling): then it leaves the waiting queue and its host blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.pool.release(seq.block_table)
        else:
            self.queues.remove(seq)
            if seq.status is SeqStatus.SWAPPED:
                self.host_pool.release(seq.block_table)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.block_table = []

    # mechanics

    def _schedule(self, step: Step, seq: Sequence, n: int, encoder_cost: int = 0) -> None:
        """`seq`'s next `n` tokens go into the step; `encoder_cost`: the image placeholder rows they encode (what
        `_encoder_cut` found for this chunk)."""
        if seq.lora >= 0:
            step.loras.add(seq.lora)
        if seq.images:
            step.encoder_budget -= encoder_cost
            step.encoder_tokens += encoder_cost
            self.encoder.scheduled(seq.images, seq.num_computed, n)
        step.seqs.append(seq)
        step.num_new.append(n)
        step.encoder_cost.append(encoder_cost)
        step.token_budget -= n
        self.queues.charge(seq, n)
        if seq.first_scheduled_at is None:
            seq.first_scheduled_at = self.clock()

    def _lora_fits(self, seq: Sequence, step: Step) -> bool:
        """Whether `seq`'s adapter is in the step already or there is room for one more (max_loras)."""
        return seq.lora < 0 or seq.lora in step.loras or len(step.loras) < self.config.max_loras

    def _encoder_cut(self, seq: Sequence, n: int, step: Step) -> tuple[int, int]:
        """(the chunk of `n` tokens ended before the first image it begins that the step's encoder budget has no room
        for, the image placeholder rows that chunk encodes): an image in the worker's encoder cache costs nothing."""
        if not seq.images or n == 0:
            return n, 0
        return self.encoder.cut(seq.images, seq.num_computed, n, step.encoder_budget, step.encoder_tokens == 0)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to compute in this step: what is left, within the budget and the prefill chunk. A chunk
        never ends inside a bidirectional image run: it ends before the run, or (starting in it) takes the run's
        rest whole if the budget holds it, else nothing this step (0)."""
        start = seq.num_computed
        n = min(seq.num_tokens - start, budget)
        if self.config.prefill_chunk:
            n = min(n, self.config.prefill_chunk)
        for img in seq.images:
            first, end = img.offset, img.offset + img.length
            if img.bidirectional and first < start + n < end:
                if first > start:
                    return first - start
                return end - start if end - start <= budget else 0
        return n

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.pool.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def _make_room(self, seq: Sequence, num_tokens: int, step: Step) -> bool:
        """Grow `seq` to `num_tokens`, preempting lower-priority / younger rows; else preempt `seq`."""
        while not self._grow(seq, num_tokens):
            victims = [s for s in self.running if s is not seq and s not in step.seqs]
            victim = min(victims, key=victim_order, default=None)
            if victim is None or victim_order(victim) > victim_order(seq):
                self._preempt(seq, step)
                return False
            self._preempt(victim, step)
        return True

    def _evict_lower(self, seq: Sequence, step: Step, slots: bool = False, blocks: int = 0) -> bool:
        """Preempt running rows of lower priority than waiting `seq` until a slot / `blocks` are free."""
        lower = sorted((s for s in self.running if s.priority < seq.priority), key=victim_order)
        if slots:
            if not lower:
                return False
            self._preempt(lower[0], step)
            return True
        freeable = sum(len(s.block_table) for s in lower)
        if self.pool.num_free + freeable < blocks:
            return False  # evicting everything lower would still not make it fit
        for victim in lower:
            if self.pool.num_free >= blocks:
                break
            self._preempt(victim, step)
        return self.pool.num_free >= blocks

    def _preempt(self, seq: Sequence, step: Step) -> None:
        if seq in step.seqs:  # refund: it leaves this step's batch; its tokens and encoder rows go back to the budget
            i = step.seqs.index(seq)
            step.token_budget += step.num_new[i]
            step.encoder_budget += step.encoder_cost[i]
            step.encoder_tokens -= step.encoder_cost[i]
            self.queues.charge(seq, -step.num_new[i])
            del step.seqs[i], step.num_new[i], step.encoder_cost[i]
        self.running.remove(seq)
        seq.draft = None
        seq.num_preemptions += 1
        step.preempted.append(seq)
        if self._swap_mode(seq):
            host = self.host_pool.allocate(len(seq.block_table))
            step.swap_out.extend(zip(seq.block_table, host))
            self.pool.release(seq.block_table)
            seq.block_table = host
            seq.status = SeqStatus.SWAPPED
        else:
            self.pool.release(seq.block_table)
            seq.block_table = []
            seq.block_hashes = []
            seq.num_computed = 0
            seq.status = SeqStatus.WAITING
        seq.reserved_blocks = 0
        self.queues.requeue(seq)

    def _swap_mode(self, seq: Sequence) -> bool:
        mode = self.config.preemption
        if mode == Preemption.RECOMPUTE or self.host_pool is None or not self.host_pool.can_allocate(len(seq.block_table)):
            return False
        if mode == Preemption.AUTO:
            return self.prefer_swap is not None and self.prefer_swap(seq)
        return True

    def _admit(self, seq: Sequence, step: Step) -> bool:
        cfg, pool = self.config, self.pool
        p = seq.params
        grows = 0 if p.prefill_only else 1  # an embed or scoring row never holds a generated token
        if seq.status is SeqStatus.SWAPPED:
            need = pool.blocks_for(seq.num_tokens + grows)
            hits = []
        else:
            # mean and cls pooling and prompt logprobs need their positions computed by this row: no cached
            # prefix for them (as vLLM skips the cache for prompt_logprobs requests)
            reads = (pool.enable_caching and (p.pooling is None or p.pooling.reads_prefix_cache)
                     and p.prompt_logprobs is None)
            hashes = block_hashes(seq.token_ids, pool.block_size, parent=seq.prefix_root, images=seq.images) if reads else []
            hits = pool.cached_prefix(hashes[: (seq.num_tokens - 1) // pool.block_size])
            need = pool.blocks_for(seq.num_tokens + grows) - len(hits) + sum(pool.ref[b] == 0 for b in hits)
            step.prefix_query_tokens += seq.num_tokens
        reserve = self._reserve_need(seq) if cfg.admission == Admission.RESERVE else 0
        outstanding = self._outstanding_reservations() if cfg.admission == Admission.RESERVE else 0  # else always 0: skip the O(running) sum
        need_free = max(need, reserve - len(hits)) + outstanding + cfg.watermark_blocks
        if need_free > pool.num_free and not self._evict_lower(seq, step, blocks=need_free):
            return False
        self.queues.pop(seq)
        if seq.status is SeqStatus.SWAPPED:
            device = pool.allocate(len(seq.block_table))
            step.swap_in.extend(zip(seq.block_table, device))
            self._host_to_free.extend(seq.block_table)
            seq.block_table = device
        else:
            pool.take(hits)
            seq.block_table = list(hits)
            seq.block_hashes = hashes[: len(hits)]
            seq.num_computed = len(hits) * pool.block_size
            seq.prefix_hit_tokens += seq.num_computed
            step.prefix_hit_tokens += seq.num_computed
        seq.reserved_blocks = reserve
        seq.status = SeqStatus.RUNNING
        seq.arrival = self._arrivals
        self._arrivals += 1
        self.running.append(seq)
        return True

    def _reserve_need(self, seq: Sequence) -> int:
        if seq.params.prefill_only:  # no output to reserve for
            return self.pool.blocks_for(seq.num_prompt)
        return self.pool.blocks_for(min(seq.num_prompt + seq.params.max_tokens, self.max_model_len))

    def _outstanding_reservations(self) -> int:
        return sum(max(0, s.reserved_blocks - len(s.block_table)) for s in self.running)
