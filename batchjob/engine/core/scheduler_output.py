"""SchedulerOutput: what the engine hands its executor for one step, as plain data (vLLM v1's SchedulerOutput). The
rows the worker has not seen come with everything it keeps of them (NewRow); the rows it holds come with only what
changed since it last saw them (RowUpdate: new token ids, the blocks their table gained or lost); every scheduled
row with its computed count, its new tokens and how many positions it samples (ScheduledRow); and the rows
preempted since the last step. WorkerView, on the engine's side, remembers what the worker was sent, so each step
sends the difference. The worker keeps its rows (engine/worker/input_batch.py InputBatch) until the engine releases
them (Executor.release)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from batchjob.engine.core.scheduler import Step
from batchjob.engine.core.sequence import ImageSlot, SamplingParams, Sequence

if TYPE_CHECKING:  # a step mask holds torch tensors; this module stays torch-free
    from batchjob.engine.structured.rows import StepMask


class NewRow(NamedTuple):  # NamedTuples: immutable, and made at C speed (a step makes one per row)
    """A row the worker has not seen: what it keeps of it between steps."""
    seq_id: int
    num_prompt: int
    token_ids: tuple[int, ...]  # every known token: the prompt, then the output so far (placeholders not included)
    block_table: tuple[int, ...]
    params: SamplingParams
    rng_key: int
    stop_token_set: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids: masked until min_tokens
    images: tuple[ImageSlot, ...] = ()  # the prompt's images (their encoder outputs are the worker's to compute)


class RowUpdate(NamedTuple):
    """A row the worker holds, changed since it last saw it."""
    seq_id: int
    new_token_ids: tuple[int, ...]  # known tokens it has not been sent, in order
    kept_blocks: int  # its block table keeps this many leading blocks ...
    new_blocks: tuple[int, ...]  # ... followed by these


class ScheduledRow(NamedTuple):
    """One row of the step, in the step's order."""
    seq_id: int
    num_computed: int  # tokens whose K/V are cached before this step
    num_new: int  # tokens computed in this step
    num_sampled: int  # positions sampled: 0 (a mid-prompt chunk, an embed or a scoring row), 1, or 1 + proposals
    draft: tuple[int, ...] = ()  # speculative proposals, read after the row's known tokens


@dataclass(slots=True)
class SchedulerOutput:
    rows: list[ScheduledRow] = field(default_factory=list)
    new_rows: list[NewRow] = field(default_factory=list)
    updates: list[RowUpdate] = field(default_factory=list)
    preempted_ids: list[int] = field(default_factory=list)  # their block tables are gone until they resume
    # the structured rows' token bitmask over the sampled positions (filled while the forward runs), or None
    grammar: StepMask | None = None

    @property
    def num_new(self) -> list[int]:
        return [r.num_new for r in self.rows]


def num_sampled(seq: Sequence, num_new: int) -> int:
    """Positions a row samples in a step that computes `num_new` of its tokens: none while its prompt is still
    being read (or for an embed or scoring row), one at its last token, plus one per proposal it verifies."""
    k = seq.num_computed + num_new - len(seq.token_ids) - seq.num_placeholders  # proposals past its known tokens
    return k + 1 if k >= 0 and not seq.params.prefill_only else 0


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
        rows, new_rows, sent_of = out.rows, out.new_rows, self._sent
        for seq, n in zip(step.seqs, step.num_new):
            seq_id, table, tokens = seq.seq_id, seq.block_table, seq.token_ids
            sent = sent_of.get(seq_id)
            if sent is None:
                new_rows.append(NewRow(seq_id, len(seq.prompt_ids), tuple(tokens), tuple(table), seq.params, seq.rng_key,
                                       seq.stop_token_set, seq.images))
                sent_of[seq_id] = [len(tokens), table, len(table)]
            else:
                held, old, blocks = sent
                kept = blocks if old is table else _shared_prefix(old, blocks, table)
                if len(tokens) > held or kept != blocks or kept < len(table):
                    out.updates.append(RowUpdate(seq_id, tuple(tokens[held:]), kept, tuple(table[kept:])))
                    sent[0], sent[1], sent[2] = len(tokens), table, len(table)
            draft = seq.draft
            rows.append(ScheduledRow(seq_id, seq.num_computed, n, num_sampled(seq, n), tuple(draft) if draft else ()))
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
