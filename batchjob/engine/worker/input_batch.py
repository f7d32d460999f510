"""The worker's rows and a step's flat inputs. InputBatch is the worker's persistent batch (vLLM v1's InputBatch, in
its small form): every row it has been sent, with its token ids, block table, sampling parameters and what the
sampler and the pooler keep between steps, updated from each SchedulerOutput by difference and dropped when the
engine releases the row. `step_inputs` lays a step's rows out as the model's flat inputs: token ids, positions and
the paged-attention metadata (block tables, context lengths, query offsets, slot mapping), built with numpy over
whole arrays (a Python loop per row, never per token)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from batchjob.engine.core.scheduler import Step
from batchjob.engine.core.scheduler_output import SchedulerOutput, WorkerView
from batchjob.engine.params import ImageSlot, SamplingParams
from batchjob.engine.sample.penalties import PenaltyState
from batchjob.kernels import AttentionMetadata


@dataclass(slots=True, eq=False)
class CachedRow:
    """What the worker keeps of a row between steps, and (set by InputBatch.update) its part of the current step."""
    seq_id: int
    num_prompt: int
    token_ids: list[int]  # the known ids: prompt, then output (the worker's copy)
    block_table: list[int]
    params: SamplingParams
    rng_key: int
    stop_token_set: frozenset[int]
    penalties: PenaltyState | None = None  # the sampler's token counts (engine/sample/penalties.py)
    pooled: torch.Tensor | None = None  # embed rows: the pooling over the chunks computed so far (pooler.py)
    images: tuple[ImageSlot, ...] = ()  # the prompt's images
    lora: int = -1  # its LoRA adapter's slot (-1: the base model)
    # their encoder outputs [length, hidden], computed at the first step that reads any of an image's placeholders
    # and kept until the prompt is computed (chunked prefill may split a run); encoder.py
    encoded: dict[int, torch.Tensor] | None = None  # made by the first image row's step (no dict for text rows)
    # M-RoPE models' image rows: the prompt's [3, num_prompt] positions and the generated tokens' delta (mrope.py)
    mrope: tuple[torch.Tensor, int] | None = None
    num_computed: int = 0  # this step: tokens cached before it
    num_new: int = 0  # this step: tokens it computes
    num_sampled: int = 0  # this step: positions sampled (0, 1, or 1 + proposals)
    draft: tuple[int, ...] = ()  # this step: the proposals it verifies

    @property
    def num_output(self) -> int:
        """The output position of the first token this step samples (the sampler's row key reads it)."""
        return self.num_computed + self.num_new - max(self.num_sampled, 1) + 1 - self.num_prompt


class InputBatch:
    def __init__(self) -> None:
        self._rows: dict[int, CachedRow] = {}

    def update(self, out: SchedulerOutput) -> list[CachedRow]:
        """Apply a step's differences; returns its rows in the step's order, each with its part of the step."""
        rows = self._rows
        for seq_id in out.preempted_ids:
            rows[seq_id].block_table.clear()  # the blocks went back to the pool: a resumed row is sent its new table
        for new in out.new_rows:
            rows[new.seq_id] = CachedRow(new.seq_id, new.num_prompt, list(new.token_ids), list(new.block_table),
                                         new.params, new.rng_key, new.stop_token_set, images=new.images, lora=new.lora)
        for u in out.updates:
            row = rows[u.seq_id]
            row.token_ids.extend(u.new_token_ids)
            assert u.kept_blocks <= len(row.block_table), f"row {u.seq_id}: keeps blocks it was never sent"
            del row.block_table[u.kept_blocks:]
            row.block_table.extend(u.new_blocks)
        step = [rows[seq_id] for seq_id in out.seq_ids]
        for row, done, n, k in zip(step, out.num_computed, out.num_new, out.num_sampled):
            row.num_computed, row.num_new, row.num_sampled, row.draft = done, n, k, ()
        for i, draft in out.drafts.items():
            step[i].draft = draft
        return step

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._rows.pop(seq_id, None)

    def row(self, seq_id: int) -> CachedRow | None:
        return self._rows.get(seq_id)

    def __len__(self) -> int:
        return len(self._rows)


def rows_of(step: Step) -> list[CachedRow]:
    """A scheduled step's rows as a worker that has not seen them holds them (the KV profile, benchmarks, tests)."""
    return InputBatch().update(WorkerView().output(step))


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # int64 [tokens]
    positions: torch.Tensor  # int64 [tokens]
    meta: AttentionMetadata
    last: list[int]  # batch index of each step row's last token, in the step's row order
    placeholder_rows: list[int] = field(default_factory=list)  # step rows whose last input is a placeholder
    adapter_ids: torch.Tensor | None = None  # int32 [tokens]: each token's LoRA slot (-1: base); None: no adapter


def step_inputs(rows: list[CachedRow], block_size: int, host_copies: bool) -> StepInputs:
    """Rows are laid out decodes first (one token each), then prompt chunks, as the kernels expect. A row
    whose input runs past its known tokens reads its speculative proposals there, or (async scheduling) the
    placeholder of its token in flight, written as 0 here and filled on the device (ModelRunner)."""
    order = sorted(range(len(rows)), key=lambda i: rows[i].num_new != 1)
    flat, waiting = [], []
    for i in order:
        row = rows[i]
        start, n = row.num_computed, row.num_new
        chunk = row.token_ids[start:start + n]
        if len(chunk) < n:
            if row.draft:  # speculative: the row's last token, then its proposals
                chunk = chunk + list(row.draft[:n - len(chunk)])
            else:
                waiting.append(i)
                chunk = chunk + [0] * (n - len(chunk))
        flat.append((chunk, start, row.block_table))
    input_ids, positions, meta, ends = flatten(flat, block_size, host_copies)
    last = [0] * len(rows)
    for i, end in zip(order, ends):
        last[i] = end
    meta.key_ends = key_ends(rows, last, len(input_ids))
    if meta.key_ends is not None and meta.host is not None:
        meta.host["key_ends"] = meta.key_ends
    adapters = None
    if any(row.lora >= 0 for row in rows):
        adapters = torch.full((len(input_ids),), -1, dtype=torch.int32)
        for i, row in enumerate(rows):
            if row.lora >= 0:
                adapters[last[i] - row.num_new + 1:last[i] + 1] = row.lora
    return StepInputs(input_ids, positions, meta, last, waiting, adapters)


def key_ends(rows: list[CachedRow], last: list[int], num_tokens: int) -> torch.Tensor | None:
    """int32 [tokens]: for each token of a bidirectional image run computed in this step, the run's end (its keys
    reach past itself to the whole run); 0 elsewhere (causal). None: no such run in the step. The scheduler computes
    a run in one step (engine/core/scheduler.py _chunk), so the run's end is within its row's context."""
    out = None
    for i, row in enumerate(rows):
        start, n = row.num_computed, row.num_new
        if not row.images or start >= row.num_prompt:
            continue
        first = last[i] - n + 1  # the flat index of position `start`
        for img in row.images:
            lo, hi = max(start, img.offset), min(start + n, img.offset + img.length)
            if img.bidirectional and lo < hi:
                if out is None:
                    out = np.zeros(num_tokens, dtype=np.int32)
                out[first + lo - start:first + hi - start] = img.offset + img.length
    return None if out is None else torch.from_numpy(out)


def flatten(rows: list[tuple[list[int], int, list[int]]], bs: int, host_copies: bool):
    """(tokens, first position, block table) per row, rows of one token first -> input_ids, positions, the
    attention metadata and the batch index of each row's last token."""
    n = len(rows)
    lens = np.fromiter((len(chunk) for chunk, _, _ in rows), dtype=np.int64, count=n)
    starts = np.fromiter((start for _, start, _ in rows), dtype=np.int64, count=n)
    qsl = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    total = int(qsl[-1])
    ids = np.fromiter(itertools.chain.from_iterable(chunk for chunk, _, _ in rows), dtype=np.int64, count=total)
    row_of = np.repeat(np.arange(n), lens)
    pos = np.arange(total, dtype=np.int64) + np.repeat(starts - qsl[:-1], lens)
    seq_lens = starts + lens
    blocks = -(-seq_lens // bs)
    width = int(blocks.max()) if n else 0
    tables = np.zeros((n, width), dtype=np.int32)
    for r, (_, _, table) in enumerate(rows):
        tables[r, :blocks[r]] = table[:blocks[r]]
    slots = tables[row_of, pos // bs].astype(np.int64) * bs + pos % bs
    block_tables = torch.from_numpy(tables)
    qsl_list, seq_lens_list = qsl.tolist(), seq_lens.tolist()
    meta = AttentionMetadata(
        block_tables=block_tables, seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)), slot_mapping=torch.from_numpy(slots),
        num_decodes=int(np.count_nonzero(lens == 1)),
        # on a GPU, kernels plan from these host lists instead of reading the device tensors back (a sync)
        host={"query_start_loc": qsl_list, "seq_lens": seq_lens_list, "block_tables": block_tables} if host_copies else None,
    )
    return torch.from_numpy(ids), torch.from_numpy(pos), meta, (qsl[1:] - 1).tolist()
