"""Repetition, presence and frequency penalties (vLLM's meanings), applied in place on a step's logits. A row's
token counts are kept on the worker's row between steps (CachedRow.penalties) and caught up with its new tokens."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from batchjob.engine.params import SamplingParams


class PenalizedRow(Protocol):
    """What the penalties read of a row (the worker's CachedRow)."""
    params: SamplingParams
    num_prompt: int
    token_ids: list[int]  # prompt, then output
    penalties: PenaltyState | None  # kept on the row between steps


class PenaltyState:
    """A row's token counts for the penalties: the prompt's distinct ids (once) and output counts, caught
    up with the row's tokens at each call, so nothing is recounted."""

    __slots__ = ("prompt_ids", "counts", "counted")

    def __init__(self, row: PenalizedRow, device: torch.device):
        self.prompt_ids = torch.tensor(sorted(set(row.token_ids[:row.num_prompt])), dtype=torch.long, device=device)
        self.counts: dict[int, int] = {}
        self.counted = 0

    def catch_up(self, row: PenalizedRow) -> dict[int, int]:
        """The output tokens counted so far (a penalized row's steps run one after another: its tokens are known)."""
        counts = self.counts
        for t in row.token_ids[row.num_prompt + self.counted:]:
            counts[t] = counts.get(t, 0) + 1
        self.counted = len(row.token_ids) - row.num_prompt
        return counts


def apply_penalties(logits: torch.Tensor, penalized: list[int], rows: Seq[PenalizedRow]) -> None:
    """In place on logits [B, V], as vLLM: the repetition penalty over every token id seen in the prompt or
    the output (positive logits divided by it, negative multiplied), then logit -= frequency * count +
    presence * (count > 0) over the output tokens. Touches only the (row, token) pairs that occur. `penalized`: the
    indices into `rows` (and the logits) of the rows with a penalty."""
    vocab, device = logits.shape[-1], logits.device
    flat = logits.view(-1)
    seen: list[torch.Tensor] = []  # linear indices row * V + token
    out_rows: list[int] = []
    out_tokens: list[int] = []
    out_counts: list[int] = []
    rep_of, freq_of, pres_of = [1.0] * logits.shape[0], [0.0] * logits.shape[0], [0.0] * logits.shape[0]
    for r in penalized:
        row = rows[r]
        p = row.params
        state = row.penalties
        if state is None:
            state = row.penalties = PenaltyState(row, device)
        counts = state.catch_up(row)
        if counts:
            out_rows.extend([r] * len(counts))
            out_tokens.extend(counts)
            out_counts.extend(counts.values())
        if p.repetition_penalty != 1.0:
            seen.append(state.prompt_ids + r * vocab)
        rep_of[r], freq_of[r], pres_of[r] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
    rep, freq, pres = (torch.tensor(x, dtype=logits.dtype, device=device) for x in (rep_of, freq_of, pres_of))
    out_row = torch.tensor(out_rows, dtype=torch.long, device=device)
    out_lin = out_row * vocab + torch.tensor(out_tokens, dtype=torch.long, device=device)
    if seen:
        lin = torch.unique(torch.cat([*seen, out_lin[rep[out_row] != 1.0]]))
        rp = rep[lin // vocab]
        v = flat[lin]
        flat[lin] = torch.where(v > 0, v / rp, v * rp)
    if out_rows:
        cnt = torch.tensor(out_counts, dtype=logits.dtype, device=device)
        flat[out_lin] -= freq[out_row] * cnt + pres[out_row]
