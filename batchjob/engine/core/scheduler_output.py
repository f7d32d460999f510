"""SchedulerOutput: what the engine hands its executor for one step, as plain data (vLLM v1's SchedulerOutput). The
rows the worker has not seen come with everything it keeps of them (NewRow); the rows it holds come with only what
changed since it last saw them (RowUpdate: new token ids, the blocks their table gained or lost); the scheduled
rows' ids, computed counts, new tokens and sampled positions as parallel lists in the step's order (columns, as
vLLM's CachedRequestData: no object per row); and the rows preempted since the last step. A NewRow's and a
RowUpdate's lists are the engine's own, handed over for the worker to copy as it applies them (at the step's
start, before the engine changes them again); an executor in another process gets its own copies anyway. WorkerView, on the engine's side, remembers what the worker was sent, so each step
sends the difference. The worker keeps its rows (engine/worker/input_batch.py InputBatch) until the engine releases
them (Executor.release)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from batchjob.engine.core.scheduler import Step
from batchjob.engine.params import ImageSlot, SamplingParams


class GrammarMask(Protocol):
    """A step's token bitmask for its structured rows (engine/structured/rows.py's StepMask), filled while the forward
    runs: `wait()` gives (bitmask int32 [rows, words], the logits rows it constrains), tensors the worker stages (the
    core carries the mask and never reads it: it stays torch-free)."""

    def wait(self) -> tuple: ...


class NewRow(NamedTuple):  # NamedTuples: immutable, and made at C speed (a step makes one per row)
    """A row the worker has not seen: what it keeps of it between steps."""
    seq_id: int
    num_prompt: int
    token_ids: list[int]  # every known token: the prompt, then the output so far (placeholders not included)
    block_table: list[int]
    params: SamplingParams
    rng_key: int
    stop_token_set: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids: masked until min_tokens
    images: tuple[ImageSlot, ...] = ()  # the prompt's images (their encoder outputs are the worker's to compute)
    lora: int = -1  # its LoRA adapter's slot (-1: the base model)


class RowUpdate(NamedTuple):
    """A row the worker holds, changed since it last saw it."""
    seq_id: int
    new_token_ids: list[int]  # known tokens it has not been sent, in order
    kept_blocks: int  # its block table keeps this many leading blocks ...
    new_blocks: list[int]  # ... followed by these


@dataclass(slots=True)
class SchedulerOutput:
    # the step's rows, in its order: one entry per row in each list
    seq_ids: list[int] = field(default_factory=list)
    num_computed: list[int] = field(default_factory=list)  # tokens whose K/V are cached before this step
    num_new: list[int] = field(default_factory=list)  # tokens computed in this step
    # positions sampled: 0 (a mid-prompt chunk, an embed or a scoring row), 1, or 1 + proposals
    num_sampled: list[int] = field(default_factory=list)
    drafts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # step row -> its speculative proposals
    new_rows: list[NewRow] = field(default_factory=list)
    updates: list[RowUpdate] = field(default_factory=list)
    preempted_ids: list[int] = field(default_factory=list)  # their block tables are gone until they resume
    # the structured rows' token bitmask over the sampled positions (filled while the forward runs), or None
    grammar: GrammarMask | None = None

    def __len__(self) -> int:
        return len(self.seq_ids)



class WorkerView:
    """What the worker was sent of each row, so the next SchedulerOutput carries the difference. A row's block
    table list only grows (blocks appended) and is never changed otherwise: anything else gives the row a new list
    (BlockPool.shrink after rejected proposals, a preemption, a swap) and leaves the old one as it was. So the
    view keeps, per row, the list it last sent from and how many of its blocks the worker holds: the same list,
    the worker keeps them all; a new one, it keeps the prefix the two share (none after a preemption)."""

    def __init__(self) -> None:
        # seq id -> [tokens the worker holds, the block table list sent from, blocks of it the worker holds]
        self._sent: dict[int, list] = {}

    def output(self, step: Step) -> SchedulerOutput:
        """The step as the worker needs it (before `Scheduler.advance`)."""
        out = SchedulerOutput()
        for seq in step.preempted:
            sent = self._sent.get(seq.seq_id)
            if sent is not None:
                sent[2] = 0
                out.preempted_ids.append(seq.seq_id)
        out.num_new = list(step.num_new)
        ids, computed, sampled = out.seq_ids, out.num_computed, out.num_sampled
        new_rows, sent_of = out.new_rows, self._sent
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_new)):
            seq_id, table, tokens, done = seq.seq_id, seq.block_table, seq.token_ids, seq.num_computed
            sent = sent_of.get(seq_id)
            if sent is None:
                new_rows.append(NewRow(seq_id, len(seq.prompt_ids), tokens, table, seq.params, seq.rng_key,
                                       seq.stop_token_set, seq.images, seq.lora))
                sent_of[seq_id] = [len(tokens), table, len(table)]
            else:
                held, old, blocks = sent
                kept = blocks if old is table else _shared_prefix(old, blocks, table)
                if len(tokens) > held or kept != blocks or kept < len(table):
                    out.updates.append(RowUpdate(seq_id, tokens[held:], kept, table[kept:]))
                    sent[0], sent[1], sent[2] = len(tokens), table, len(table)
            ids.append(seq_id)
            computed.append(done)
            # positions sampled: none while its prompt is still being read (or for an embed or scoring row), one
            # at its last token, plus one per proposal past its known tokens that it verifies
            k = done + n - len(tokens) - seq.num_placeholders
            sampled.append(k + 1 if k >= 0 and not seq.params.prefill_only else 0)
            if seq.draft:
                out.drafts[i] = tuple(seq.draft)
        return out

    def release(self, seq_ids) -> None:
        """Rows the engine is done with (finished, or taken back before they finished)."""
        for seq_id in seq_ids:
            self._sent.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._sent)


def _shared_prefix(old: list[int], held: int, table: list[int]) -> int:
    """How many leading blocks a table shares with the first `held` of an old one."""
    n = min(held, len(table))
    i = 0
    while i < n and old[i] == table[i]:
        i += 1
    return i
