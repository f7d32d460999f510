"""SchedulerOutput: what the engine hands its executor for one step, as plain data (vLLM v1's SchedulerOutput). The
rows the worker has not seen come with everything it keeps of them (NewRow); the rows it holds come with only what
changed since it last saw them (RowUpdate: new token ids, the blocks their table gained or lost); every scheduled
row with its computed count, its new tokens and how many positions it samples (ScheduledRow); and the rows
preempted since the last step. WorkerView, on the engine's side, remembers what the worker was sent, so each step
sends the difference. The worker keeps its rows (engine/worker/input_batch.py InputBatch) until the engine releases
them (Executor.release)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchjob.engine.core.scheduler import Step
from batchjob.engine.core.sequence import SamplingParams, Sequence

if TYPE_CHECKING:  # a step mask holds torch tensors; this module stays torch-free
    from batchjob.engine.structured.rows import StepMask


@dataclass(frozen=True, slots=True)
class NewRow:
    """A row the worker has not seen: what it keeps of it between steps."""
    seq_id: int
    num_prompt: int
    token_ids: tuple[int, ...]  # every known token: the prompt, then the output so far (placeholders not included)
    block_table: tuple[int, ...]
    params: SamplingParams
    rng_key: int
    stop_token_set: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids: masked until min_tokens


@dataclass(frozen=True, slots=True)
class RowUpdate:
    """A row the worker holds, changed since it last saw it."""
    seq_id: int
    new_token_ids: tuple[int, ...]  # known tokens it has not been sent, in order
    kept_blocks: int  # its block table keeps this many leading blocks ...
    new_blocks: tuple[int, ...]  # ... followed by these


@dataclass(frozen=True, slots=True)
class ScheduledRow:
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
    k = seq.num_computed + num_new - seq.num_tokens  # proposals past its known tokens (and placeholders)
    return k + 1 if k >= 0 and not seq.params.prefill_only else 0


@dataclass(slots=True)
class _Sent:
    num_tokens: int  # leading token ids the worker holds
    table: list[int]  # the Sequence's block table list it was sent from (a new list means a new table)
    blocks: list[int]  # the worker's copy of that table


class WorkerView:
    """What the worker was sent of each row, so the next SchedulerOutput carries the difference. A row's block
    table list only grows (blocks appended); anything else gives the row a new list (BlockPool.shrink after
    rejected proposals, a preemption, a swap): the worker then keeps the prefix its copy shares with the new table
    (none after a preemption) and is sent the rest."""

    def __init__(self) -> None:
        self._sent: dict[int, _Sent] = {}

    def output(self, step: Step) -> SchedulerOutput:
        """The step as the worker needs it (before `Scheduler.advance`)."""
        out = SchedulerOutput()
        for seq in step.preempted:
            sent = self._sent.get(seq.seq_id)
            if sent is not None:
                sent.blocks.clear()
                out.preempted_ids.append(seq.seq_id)
        for seq, n in zip(step.seqs, step.num_new):
            table, sent = seq.block_table, self._sent.get(seq.seq_id)
            if sent is None:
                out.new_rows.append(NewRow(seq.seq_id, seq.num_prompt, tuple(seq.token_ids), tuple(table), seq.params,
                                           seq.rng_key, seq.stop_token_set))
                self._sent[seq.seq_id] = _Sent(len(seq.token_ids), table, list(table))
            else:
                kept = len(sent.blocks) if sent.table is table else _shared_prefix(sent.blocks, table)
                if len(seq.token_ids) > sent.num_tokens or kept != len(sent.blocks) or kept < len(table):
                    out.updates.append(RowUpdate(seq.seq_id, tuple(seq.token_ids[sent.num_tokens:]), kept,
                                                 tuple(table[kept:])))
                    sent.num_tokens, sent.table = len(seq.token_ids), table
                    del sent.blocks[kept:]
                    sent.blocks.extend(table[kept:])
            out.rows.append(ScheduledRow(seq.seq_id, seq.num_computed, n, num_sampled(seq, n), tuple(seq.draft or ())))
        return out

    def release(self, seq_ids) -> None:
        """Rows the engine is done with (finished, or taken back before they finished)."""
        for seq_id in seq_ids:
            self._sent.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._sent)


def _shared_prefix(sent: list[int], table: list[int]) -> int:
    """How many leading blocks two tables share."""
    n = min(len(sent), len(table))
    i = 0
    while i < n and sent[i] == table[i]:
        i += 1
    return i
