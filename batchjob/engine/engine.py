"""Engine: add rows, call `step()` until idle. Each step is one scheduler decision, one forward, one
sampling pass; rows that finish leave with their output and their blocks return to the pool."""
from __future__ import annotations

from dataclasses import dataclass

from batchjob.engine.block_pool import BlockPool
from batchjob.engine.model_runner import ModelRunner
from batchjob.engine.scheduler import Scheduler, SchedulerConfig, Step
from batchjob.engine.sequence import SamplingParams, Sequence, SeqStatus
from batchjob.models.llama import LlamaModel


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 0  # 0 = derive from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30
    scheduler: SchedulerConfig | None = None


@dataclass(slots=True)
class StepStats:
    num_seqs: int
    num_tokens: int
    num_decode: int
    num_prefill_tokens: int
    num_finished: int
    num_preempted: int
    num_running: int
    num_waiting: int
    blocks_used: int
    blocks_free: int


class Engine:
    def __init__(self, model: LlamaModel, eos_token_ids: list[int], config: EngineConfig | None = None):
        config = config or EngineConfig()
        num_blocks = config.num_blocks or max(
            2, config.kv_cache_bytes // ModelRunner.kv_bytes_per_block(model, config.block_size)
        )
        self.model = model
        self.max_model_len = model.config.max_position_embeddings
        self.eos = frozenset(eos_token_ids)
        self.pool = BlockPool(num_blocks, config.block_size)
        self.scheduler = Scheduler(config.scheduler or SchedulerConfig(), self.pool)
        self.runner = ModelRunner(model, num_blocks, config.block_size)
        self.last_step: Step | None = None
        self.last_stats: StepStats | None = None

    def add(self, seq: Sequence) -> str | None:
        """Queue a row. Returns an error message (and queues nothing) when the row can never run."""
        n = seq.num_prompt
        if n == 0:
            return "empty prompt: it has no tokens"
        if n >= self.max_model_len:
            return f"prompt has {n} tokens; the model's context is {self.max_model_len} (prompt + 1 generated token must fit)"
        if self.pool.blocks_for(n + 1) + self.scheduler.config.watermark_blocks > self.pool.num_blocks:
            return f"prompt has {n} tokens; the KV cache holds {self.pool.num_blocks * self.pool.block_size} tokens"
        self.scheduler.add(seq)
        return None

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[Sequence]:
        """Run one iteration; returns the rows that finished in it."""
        sched = self.scheduler
        step = sched.schedule()
        self.last_step = step
        finished: list[Sequence] = []
        if step:
            tokens = self.runner.run(step)
            for seq, n, tok in zip(step.seqs, step.num_new, tokens):
                seq.num_computed += n
                if tok is None:
                    continue
                seq.token_ids.append(tok)
                reason = self._finish_reason(seq, tok)
                if reason:
                    sched.finish(seq, reason)
                    finished.append(seq)
        elif sched.waiting and not sched.running:
            raise RuntimeError("scheduler made no progress with an empty batch (a row cannot be admitted)")
        num_decode = sum(1 for n in step.num_new if n == 1)
        self.last_stats = StepStats(
            num_seqs=len(step.seqs), num_tokens=step.num_tokens, num_decode=num_decode,
            num_prefill_tokens=step.num_tokens - num_decode, num_finished=len(finished),
            num_preempted=len(step.preempted), num_running=len(sched.running), num_waiting=len(sched.waiting),
            blocks_used=self.pool.num_used, blocks_free=self.pool.num_free,
        )
        return finished

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p: SamplingParams = seq.params
        if not p.ignore_eos and tok in self.eos:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if seq.num_output >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], seed: int = 0) -> list[Sequence]:
        """Convenience for tests and benchmarks: run prompts to completion, return sequences in input order."""
        from batchjob.engine.sampler import row_key

        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [Sequence(i, list(p), plist[i], rng_key=row_key(seed, i)) for i, p in enumerate(prompts)]
        for s in seqs:
            err = self.add(s)
            if err:
                s.status, s.finish_reason = SeqStatus.FINISHED, "error"
        while self.has_work:
            self.step()
        return seqs
