"""Sampler: greedy, temperature, top-k, top-p, with one uniform number per row and step.

A row's random draw at output position t is a pure function of (row key, t): the same text comes out
whatever the row was batched with, and after a preemption or a resume. Sampling uses the inverse CDF
(one uniform per row) instead of per-vocabulary noise, so it costs one cumsum per sampled row.
"""
from __future__ import annotations

import torch

from batchjob.engine.sequence import SamplingParams

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_key(seed: int, row_index: int, sample_index: int = 0) -> int:
    return splitmix64(splitmix64(splitmix64(seed & _MASK64) ^ row_index) ^ sample_index)


def uniform(key: int, position: int) -> float:
    """A float in [0, 1) with 53 random bits."""
    return (splitmix64(key ^ splitmix64(position)) >> 11) * (1.0 / (1 << 53))


def sample(logits: torch.Tensor, params: list[SamplingParams], keys: list[int], positions: list[int]) -> list[int]:
    """logits: [B, V] float32. Returns one token id per row."""
    out = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        idx = torch.tensor(sampled)
        rows = logits[idx]
        temps = torch.tensor([params[i].temperature for i in sampled], dtype=torch.float32)
        rows = rows / temps[:, None]
        top_k = [params[i].top_k for i in sampled]
        top_p = [params[i].top_p for i in sampled]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            rows = _mask_top_k_top_p(rows, top_k, top_p)
        probs = torch.softmax(rows, dim=-1, dtype=torch.float64)
        u = torch.tensor([uniform(keys[i], positions[i]) for i in sampled], dtype=torch.float64)
        cdf = probs.cumsum(dim=-1)
        choice = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1)
        choice = choice.clamp_(max=logits.shape[-1] - 1)
        out[idx] = choice
    return out.tolist()


def _mask_top_k_top_p(rows: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = rows.shape[-1]
    sorted_logits, order = rows.sort(dim=-1, descending=True)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k])
    ranks = torch.arange(vocab)[None, :]
    drop = ranks >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= torch.tensor(top_p)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(rows).scatter_(-1, order, sorted_logits)
