"""Pooling for embed rows (`--task embed`): the final normed hidden states of a row's prompt positions, one
chunk at a time, into one vector (last position, mean in fp32, or the first), truncated and L2-normalised."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from batchjob.engine.core.scheduler import Step
from batchjob.engine.core.sequence import Pooling
from batchjob.engine.worker.row_state import RowStates


def pool_step(hidden: torch.Tensor, step: Step, last: list[int], states: RowStates) -> list[tuple[int, torch.Tensor]]:
    """Fold this step's chunk of each embed row into its pooling state (the worker's RowState); returns (step row,
    vector) for the rows whose last prompt chunk this step computes. Before `Scheduler.advance`: a row's
    `num_computed` is where its chunk starts; a chunk at 0 starts the pooling afresh (a recomputed row)."""
    done = []
    for i, (seq, n) in enumerate(zip(step.seqs, step.num_new)):
        p = seq.params.pooling
        if p is None:
            continue
        start, first = seq.num_computed, last[i] - n + 1
        row = states.of(seq.seq_id)
        if start == 0:
            row.pooled = None
        if p.pooling == Pooling.MEAN:
            part = hidden[first:last[i] + 1].float().sum(0)
            row.pooled = part if row.pooled is None else row.pooled + part
        elif p.pooling == Pooling.CLS and start == 0:
            row.pooled = hidden[first].float().clone()
        if start + n < seq.num_tokens:
            continue
        if p.pooling == Pooling.MEAN:
            vec = row.pooled / seq.num_prompt
        elif p.pooling == Pooling.CLS:
            vec = row.pooled
        else:
            vec = hidden[last[i]].float()
        row.pooled = None
        if p.dimensions is not None:
            vec = vec[:p.dimensions]
        if p.normalize:
            vec = F.normalize(vec, dim=-1)
        done.append((i, vec))
    return done
