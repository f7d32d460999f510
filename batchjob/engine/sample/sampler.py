"""Sampler: one pass over a step's rows -> one token per row, plus logprobs for the rows that ask.

The order is vLLM's: raw logprobs (log-softmax of the model's logits) -> allowed_token_ids -> min_tokens mask and the
row's banned tokens (SamplingParams.banned_next) -> penalties ->
argmax for greedy rows; temperature -> min_p -> top-k -> top-p -> draw for the others. Each stage runs
once over all the rows that use it; a greedy row without penalties costs its share of one argmax.

A row's random draw at output position t is a pure function of (row key, t) (engine/sample/row_keys.py): the
same text comes out whatever the row was batched with, and after a preemption or a resume. Sampling uses
the inverse CDF (one uniform per row) instead of per-vocabulary noise, so it costs one cumsum per sampled row.
"""
from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from batchjob.engine.sample.penalties import PenalizedRow, apply_penalties
from batchjob.engine.sample.row_keys import uniform
from batchjob.engine.structured.mask import apply_token_bitmask_
from batchjob.kernels import argmax_rows


class SampledRow(PenalizedRow, Protocol):
    """What the sampler reads of a row (the worker's CachedRow, or a draft model's row): its parameters, its output
    position (the row key's counter) and the tokens its min_tokens masks."""
    rng_key: int
    stop_token_set: frozenset[int]

    @property
    def num_output(self) -> int: ...

# a generated token's logprobs: (token id, its logprob, the top alternatives [(id, logprob)])
LogprobEntry = tuple[int, float, tuple[tuple[int, float], ...]]


def sample(logits: torch.Tensor, seqs: Seq[SampledRow], argmax=None, offsets: list[int] | None = None,
           mask: tuple[torch.Tensor, torch.Tensor] | None = None) -> SampledTokens:
    """logits: [B, V] for the worker's rows `seqs` (the sampled token is at output position `row.num_output`).
    Returns one token id per row, still on the logits' device (`SampledTokens.tolist()` waits for them); rows
    with `params.logprobs` set get an entry in `SampledTokens.logprobs()` then. `argmax`: a kernel equal to
    `argmax_rows` (the model's kernel set may have a faster one). Greedy rows never wait for the device
    here; top-p rows whose nucleus may pass the window read one flag back. `offsets`: a row of logits
    for output position `seq.num_output + offset` (speculative verification: one row of `seqs` per
    proposed position; such rows use no penalties, logprobs or unmet min_tokens). Penalty counts are kept on the
    rows between steps (CachedRow.penalties)."""
    argmax = argmax or argmax_rows
    params = [s.params for s in seqs]
    vocab = logits.shape[-1]
    device = logits.device
    want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw_lp = torch.log_softmax(logits[want_lp].float(), dim=-1) if want_lp else None
    if mask is not None:  # structured rows: tokens their grammar forbids get -inf, after the raw logprobs (vLLM's order)
        bitmask, rows = mask
        apply_token_bitmask_(logits, bitmask, rows)

    banned = [(i, t) for i, s in enumerate(seqs) if s.num_output < s.params.min_tokens
              for t in s.stop_token_set if t < vocab]
    banned += [(i, t) for i, s in enumerate(seqs) if s.params.bans_tokens
               for t in s.params.banned_next(s.token_ids[s.num_prompt:]) if t < vocab]
    penalized = [i for i, p in enumerate(params) if p.penalized]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids]
    writes = banned or penalized or allowed
    if writes or sampled or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        widened = logits.float()  # a copy unless already fp32: masks and penalties below write into it
        logits = widened.clone() if widened is logits and writes else widened
    # else: greedy rows only: the argmax of the model-dtype logits is that of their exact fp32 widening
    if allowed:
        keep_allowed(logits, allowed, params)
    if banned:
        rows, toks = zip(*banned)
        logits[torch.tensor(rows, device=device), torch.tensor(toks, device=device)] = float("-inf")
    if penalized:
        apply_penalties(logits, penalized, seqs)

    if len(sampled) < len(params):
        out = argmax(logits)
    else:  # no greedy row: skip the argmax pass
        out = torch.empty(len(params), dtype=torch.long, device=device)
    if sampled:
        idx = torch.tensor(sampled, device=device)
        sp = [params[i] for i in sampled]
        temps = torch.tensor([p.temperature for p in sp], device=device)[:, None]
        rows = (logits if len(sampled) == len(params) else logits[idx]) / temps
        off = offsets or [0] * len(seqs)
        u = torch.tensor([uniform(seqs[i].rng_key, seqs[i].num_output + off[i]) for i in sampled], dtype=torch.float64, device=device)
        choice = torch.empty(len(sampled), dtype=torch.long, device=device)
        for rows_of, ids, weights in candidates(rows, [p.top_k for p in sp], [p.top_p for p in sp], [p.min_p for p in sp]):
            cdf = weights.cumsum(dim=-1, dtype=torch.float64)
            # right=True: the first token whose CDF passes u, so a zero-weight (masked) token is never drawn
            pick = torch.searchsorted(cdf, u[rows_of][:, None] * cdf[:, -1:], right=True).clamp_(max=cdf.shape[-1] - 1)
            choice[rows_of] = pick.squeeze(1) if ids is None else ids.gather(1, pick).squeeze(1)
        out[idx] = choice
    return SampledTokens(out, raw_lp, [params[i].logprobs for i in want_lp], want_lp)


def keep_allowed(logits: torch.Tensor, rows: list[int], params: list) -> None:
    """Rows with allowed_token_ids: every other token gets -inf (ids past the vocabulary are ignored)."""
    vocab = logits.shape[-1]
    keep = torch.zeros(len(rows), vocab, dtype=torch.bool)
    for k, i in enumerate(rows):
        keep[k, [t for t in params[i].allowed_token_ids if t < vocab]] = True
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill_(~keep.to(logits.device), float("-inf"))


class SampledTokens:
    """A step's sampled token ids on their way back from the device. On CUDA they are copied into pinned
    host memory behind the step's kernels (non_blocking) and an event marks the copy, so the host can
    prepare the next step while the GPU finishes this one; `tolist()` waits for the event. The logprobs
    of the rows that asked are read then, from the tokens that came back (`logprobs()`)."""

    __slots__ = ("ids", "host", "event", "raw_lp", "lp_top", "lp_rows", "_tokens", "_logprobs")

    def __init__(self, ids: torch.Tensor, raw_lp: torch.Tensor | None = None, lp_top=(), lp_rows=()):
        """`lp_rows`: the rows (of `ids`) whose logprobs `raw_lp` holds, `lp_top` how many alternatives each wants."""
        self.ids, self.raw_lp, self.lp_top, self.lp_rows = ids, raw_lp, list(lp_top), list(lp_rows)
        self.host = self.event = self._tokens = None
        self._logprobs: dict[int, LogprobEntry] = {}
        if ids.device.type == "cuda":
            self.host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self.host.copy_(ids, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def __len__(self) -> int:
        return self.ids.shape[0]

    def tolist(self) -> list[int]:
        if self._tokens is None:
            if self.event is not None:
                self.event.synchronize()
            tokens = (self.host if self.host is not None else self.ids).tolist()
            if self.lp_rows:
                self._logprobs = _logprob_entries(self.raw_lp, self.lp_top, self.lp_rows, tokens)
            self._tokens = tokens
        return self._tokens

    def logprobs(self) -> dict[int, LogprobEntry]:
        """Sampled row -> its token's logprob entry, for the rows that asked (waits for the tokens)."""
        self.tolist()
        return self._logprobs


NUCLEUS_WINDOW = 1024  # top-p without top-k looks at the 1024 most likely tokens; the whole vocabulary only if needed


def candidates(rows: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]):
    """Temperature-scaled logits [R, V] -> groups (rows, ids, weights): each row's sampleable tokens with
    unnormalized weights, 0 where masked; `ids` None means the whole vocabulary in token order. vLLM's
    order and definitions: min_p (p >= min_p * p_max), then top-k (the k most likely), then top-p (the
    smallest prefix of the rest, most likely first, whose mass reaches top_p). Off: top_k 0 (or >= V),
    top_p 1, min_p 0.

    Rows are grouped by how many tokens they need in order (k, the nucleus window, or none), so no row
    pays for a full sort of the vocabulary unless its nucleus is wider than the window. A row's path
    depends on its own parameters and logits only: its draw is the same in any batch."""
    device, vocab = rows.device, rows.shape[-1]
    if any(m > 0 for m in min_p):  # p >= min_p * p_max  <=>  logit >= logit_max + log(min_p)
        floor = torch.tensor([math.log(m) if m > 0 else float("-inf") for m in min_p], device=device)
        rows = rows.masked_fill(rows < rows.amax(dim=-1, keepdim=True) + floor[:, None], float("-inf"))
    groups: dict[tuple[str, int], list[int]] = {}
    for j, (k, p) in enumerate(zip(top_k, top_p)):
        if 0 < k < vocab:
            key = ("top_k", k)
        elif p < 1.0:
            key = ("window", min(NUCLEUS_WINDOW, vocab))
        else:
            key = ("all", 0)
        groups.setdefault(key, []).append(j)
    out = []
    for (kind, width), js in groups.items():
        idx = torch.tensor(js, device=device)
        sub = rows[idx]
        if kind == "all":  # temperature (and min_p) only
            out.append((idx, None, torch.softmax(sub, dim=-1)))
            continue
        p = torch.tensor([top_p[j] for j in js], dtype=torch.float64, device=device)[:, None]
        vals, ids = sub.topk(width, dim=-1)
        if kind == "top_k":  # the k best, renormalized among themselves, then top-p
            out.append((idx, ids, _top_p(torch.softmax(vals, dim=-1, dtype=torch.float64), p)))
            continue
        # top-p alone: the window's probabilities over the whole vocabulary
        probs = (vals.double() - torch.logsumexp(sub.double(), dim=-1, keepdim=True)).exp()
        closed = probs.sum(dim=-1) >= p.squeeze(1)  # the nucleus ends inside the window
        if bool(closed.all()):
            out.append((idx, ids, _top_p(probs, p)))
            continue
        if bool(closed.any()):
            out.append((idx[closed], ids[closed], _top_p(probs[closed], p[closed])))
        wide = ~closed
        vals, ids = sub[wide].sort(dim=-1, descending=True)
        out.append((idx[wide], ids, _top_p(torch.softmax(vals, dim=-1, dtype=torch.float64), p[wide])))
    return out


def _top_p(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """probs [R, W], most likely first and summing to 1 over the row's candidates -> zero outside the
    smallest prefix whose mass reaches p (the first token always stays)."""
    before = probs.cumsum(dim=-1) - probs
    return probs.masked_fill((before >= p) & (p < 1.0), 0.0)


def sampleable(rows: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> list[set[int]]:
    """The tokens each row can draw (for tests, and for reading the sampler)."""
    kept: list[set[int]] = [set() for _ in range(rows.shape[0])]
    for rows_of, ids, weights in candidates(rows, top_k, top_p, min_p):
        for j, r in enumerate(rows_of.tolist()):
            where = torch.nonzero(weights[j] > 0).flatten()
            kept[r] = set((where if ids is None else ids[j][where]).tolist())
    return kept


def _logprob_entries(raw_lp: torch.Tensor, tops: list[int], rows: list[int], tokens: list[int]) -> dict[int, LogprobEntry]:
    chosen = [tokens[i] for i in rows]
    top_n = max(tops)
    chosen_lp = raw_lp.gather(1, torch.tensor(chosen, device=raw_lp.device)[:, None]).squeeze(1).tolist()
    if top_n:
        top_v, top_i = raw_lp.topk(top_n, dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    return {i: (chosen[j], chosen_lp[j], tuple(zip(top_i[j][:n], top_v[j][:n])) if n else ())
            for j, (i, n) in enumerate(zip(rows, tops))}
