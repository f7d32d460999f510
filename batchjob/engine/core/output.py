"""Applying a step's sampled tokens to its rows: the token fills the row's oldest placeholder (or a
speculating row keeps its accepted proposals), stop conditions decide which rows end, and the ending rows
leave the scheduler. vLLM's `update_from_output`, beside the scheduler; the engine only runs the loop."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from batchjob.engine.core.block_pool import BlockPool
from batchjob.engine.core.scheduler import Scheduler, Step
from batchjob.engine.params import SamplingParams
from batchjob.engine.core.sequence import Sequence, SeqStatus


class ProposalObserver(Protocol):
    """A speculative proposer's feedback: how many of a row's proposals the verification kept."""

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None: ...


@dataclass(slots=True)
class AppliedStep:
    finished: list[Sequence] = field(default_factory=list)
    num_sampled: int = 0  # tokens the rows gained (1 per sampling row, 1 + accepted per speculating row)
    num_proposed: int = 0
    num_accepted: int = 0


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, pool: BlockPool, eos_token_ids: frozenset[int], max_model_len: int,
                 proposer: ProposalObserver | None = None):
        self.scheduler = scheduler
        self.pool = pool
        self.eos = eos_token_ids
        self.max_model_len = max_model_len
        self.proposer = proposer

    def apply(self, step: Step, tokens: list[int | list[int] | None],
              embeddings: dict[int, list[float]] | None = None,
              scored: dict[int, tuple[int, list]] | None = None,
              logprobs: dict[int, list] | None = None) -> AppliedStep:
        """`tokens[i]`: what row i of the step sampled (None for a mid-prompt chunk, a list for a speculating
        row). Rows finished since the launch (async scheduling) drop theirs; rows preempted since keep it
        (it was computed from their context). `embeddings[i]`: embed row i's vector, its last chunk computed:
        it ends ("stop") now. `scored[i]`: (first position, entries) of row i's prompt logprobs from this
        step; a scoring row (max_tokens 0) ends ("stop") once its whole prompt is computed. `logprobs[i]`: the
        logprob entries of the tokens row i sampled (rows with `params.logprobs`), kept with the tokens it keeps."""
        out = AppliedStep()
        ending: list[tuple[Sequence, str]] = []
        for i, vec in (embeddings or {}).items():
            seq = step.seqs[i]
            if seq.status is not SeqStatus.FINISHED:
                seq.embedding = vec
                ending.append((seq, "stop"))
        for i, (start, entries) in (scored or {}).items():
            seq = step.seqs[i]
            if start == 0 or seq.prompt_logprobs is None:  # a chunk at 0: the row restarted (recompute)
                seq.prompt_logprobs = []
            del seq.prompt_logprobs[start:]
            seq.prompt_logprobs.extend(entries)
        for seq in step.seqs:
            p = seq.params
            if p.pooling is None and p.max_tokens == 0 and seq.status is not SeqStatus.FINISHED \
                    and seq.num_computed >= seq.num_prompt:
                seq.prompt_logprobs = seq.prompt_logprobs or []
                ending.append((seq, "stop"))
        for i, (seq, sampled) in enumerate(zip(step.seqs, tokens)):
            if seq.status is SeqStatus.FINISHED or sampled is None:
                continue
            known = len(seq.token_ids)
            if isinstance(sampled, int):
                out.num_sampled += 1
                reason = self._append(seq, sampled)
            else:
                reason = self._accept(step, i, seq, sampled, out)
            if logprobs and i in logprobs:
                if seq.logprobs is None:
                    seq.logprobs = []
                seq.logprobs.extend(logprobs[i][:len(seq.token_ids) - known])
            if reason:
                ending.append((seq, reason))
        self.scheduler.publish(step)
        for seq, reason in ending:
            self.scheduler.finish(seq, reason)
            out.finished.append(seq)
        return out

    def _append(self, seq: Sequence, tok: int) -> str | None:
        """The token of the row's oldest placeholder; a row that ends drops the placeholders after it (the
        token of a step launched after this one)."""
        seq.num_placeholders -= 1
        seq.token_ids.append(tok)
        reason = self.finish_reason(seq, tok)
        if reason:
            seq.num_placeholders = 0
        return reason

    def _accept(self, step: Step, i: int, seq: Sequence, sampled: list[int], out: AppliedStep) -> str | None:
        """Speculative: keep tokens while they equal the proposals, then the one that differs."""
        draft, kept, reason = seq.draft, 0, None
        for tok in sampled:
            seq.token_ids.append(tok)
            kept += 1
            reason = self.finish_reason(seq, tok)
            if reason or kept > len(draft) or tok != draft[kept - 1]:
                break
        seq.draft = None
        out.num_sampled += kept
        seq.num_computed -= step.num_new[i] - kept  # what holds: its last token and the kept proposals
        step.num_new[i] = kept
        seq.block_table = self.pool.shrink(seq.block_table, seq.num_tokens)  # blocks that held only rejected ones
        accepted = kept if kept <= len(draft) and sampled[kept - 1] == draft[kept - 1] else kept - 1
        if self.proposer is not None:
            self.proposer.observe(seq, len(draft), accepted)
        out.num_proposed += len(draft)
        out.num_accepted += accepted
        return reason

    def finish_reason(self, seq: Sequence, tok: int) -> str | None:
        """Why `seq` ends at `tok`, its newest known token (placeholders after it do not count)."""
        p: SamplingParams = seq.params
        # the detokenizer sees every token, so a row's text includes a (non-special) stop token, as in vLLM
        stop_string = seq.detokenizer is not None and seq.detokenizer.step(tok)
        if stop_string or (not p.ignore_eos and tok in self.eos) or tok in p.stop_token_ids:
            return "stop"
        if seq.matcher is not None:  # a structured row: its grammar moves with every token it keeps
            if not seq.matcher.consume(tok) or seq.matcher.error:
                seq.error = f"structured_outputs: {seq.matcher.error or f'token {tok} does not fit the grammar'}"
                return "error"
            if seq.matcher.is_finished():  # complete: nothing but EOS could follow
                return "stop"
        known = len(seq.token_ids)
        if known - seq.num_prompt >= p.max_tokens or known >= self.max_model_len:
            return "length"
        return None
