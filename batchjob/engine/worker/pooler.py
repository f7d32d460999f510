"""Pooling for embed rows (`--task embed`): the final normed hidden states of a row's prompt positions, one
chunk at a time, into one vector (last position, mean in fp32, or the first), truncated and L2-normalised."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from batchjob.engine.params import Pooling
from batchjob.engine.worker.input_batch import CachedRow


def pool_step(hidden: torch.Tensor, rows: list[CachedRow], last: list[int]) -> list[tuple[int, torch.Tensor]]:
    """Fold this step's chunk of each embed row into its pooling state (CachedRow.pooled); returns (step row,
    vector) for the rows whose last prompt chunk this step computes. A row's `num_computed` is where its chunk
    starts; a chunk at 0 starts the pooling afresh (a recomputed row)."""
    done = []
    for i, row in enumerate(rows):
        p = row.params.pooling
        if p is None:
            continue
        start, n = row.num_computed, row.num_new
        first = last[i] - n + 1
        if start == 0:
            row.pooled = None
        if p.pooling == Pooling.MEAN:
            part = hidden[first:last[i] + 1].float().sum(0)
            row.pooled = part if row.pooled is None else row.pooled + part
        elif p.pooling == Pooling.CLS and start == 0:
            row.pooled = hidden[first].float().clone()
        if start + n < row.num_prompt:  # an embed row's tokens are its prompt
            continue
        if p.pooling == Pooling.MEAN:
            vec = row.pooled / row.num_prompt
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
