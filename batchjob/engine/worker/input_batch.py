"""A scheduled step as the model's flat inputs: token ids, positions and the paged-attention metadata
(block tables, context lengths, query offsets, slot mapping), built with numpy over whole arrays (a
Python loop per row, never per token)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from batchjob.engine.core.scheduler import Step
from batchjob.kernels import AttentionMetadata


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # int64 [tokens]
    positions: torch.Tensor  # int64 [tokens]
    meta: AttentionMetadata
    last: list[int]  # batch index of each step row's last token, in the step's row order
    placeholder_rows: list[int]  # step rows whose last input token is a placeholder (its id is still in flight)


def step_inputs(step: Step, block_size: int, host_copies: bool) -> StepInputs:
    """Rows are laid out decodes first (one token each), then prompt chunks, as the kernels expect. A row
    whose input runs past its known tokens reads its speculative proposals there, or (async scheduling) the
    placeholder of its token in flight, written as 0 here and filled on the device (ModelRunner)."""
    order = sorted(range(len(step.seqs)), key=lambda i: step.num_new[i] != 1)
    rows, waiting = [], []
    for i in order:
        seq, n = step.seqs[i], step.num_new[i]
        start = seq.num_computed
        chunk = seq.token_ids[start:start + n]
        if len(chunk) < n:
            if seq.draft:  # speculative: the row's last token, then its proposals
                chunk = chunk + seq.draft[:n - len(chunk)]
            else:
                waiting.append(i)
                chunk = chunk + [0] * (n - len(chunk))
        rows.append((chunk, start, seq.block_table))
    input_ids, positions, meta, ends = flatten(rows, block_size, host_copies)
    last = [0] * len(step.seqs)
    for i, end in zip(order, ends):
        last[i] = end
    return StepInputs(input_ids, positions, meta, last, waiting)


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
