"""Prompt logprobs (`prompt_logprobs: k`; `--task score`): for each prompt position a row's chunk computes, the
log-probability of the next prompt token under the LM head's log-softmax (fp32, raw logits as vLLM reports
them), whether that token is the argmax, and the top-k alternatives. One chunk at a time, like the pooling."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchjob.engine.worker.input_batch import CachedRow

SLICE_ROWS = 512  # positions per LM-head call: bounds the fp32 logits to SLICE_ROWS x vocab


@dataclass(slots=True)
class PromptLogprobChunk:
    """Row `row` of a step: the prompt tokens start+1 .. start+m scored, as tensors on the model's device."""
    row: int
    start: int  # the first position whose next token is scored: a chunk at 0 restarts the row's list
    logprobs: torch.Tensor  # [m] fp32: log p(token[p + 1] | tokens[:p + 1])
    argmax: torch.Tensor  # [m] int64: the most likely token at each position (first of equals)
    top_ids: torch.Tensor | None  # [m, k] the top-k alternatives (k = params.prompt_logprobs > 0), else None
    top_logprobs: torch.Tensor | None

    def tolist(self) -> list[tuple[float, int, list[tuple[int, float]]]]:
        """(logprob, argmax id, [(alternative id, logprob)]) per position, on the host."""
        lps, am = self.logprobs.tolist(), self.argmax.tolist()
        if self.top_ids is None:
            return [(lp, a, []) for lp, a in zip(lps, am)]
        tops = [list(zip(i, v)) for i, v in zip(self.top_ids.tolist(), self.top_logprobs.tolist())]
        return list(zip(lps, am, tops))


def score_step(model, hidden: torch.Tensor, step_rows: list[CachedRow], last: list[int]) -> list[PromptLogprobChunk]:
    """The prompt positions this step computes for rows asking for prompt logprobs (a row's `num_computed` is
    where its chunk starts). The last prompt position
    predicts the first generated token: it is not a prompt logprob. All rows' positions go through the
    LM head together, SLICE_ROWS at a time (a row's values do not depend on its neighbours: the LM head is
    batch invariant and the rest is per position)."""
    rows, at, targets = [], [], []  # (step row, start, count, k); hidden rows; the scored tokens
    for i, seq in enumerate(step_rows):
        k, n = seq.params.prompt_logprobs, seq.num_new
        if k is None:
            continue
        start = seq.num_computed
        m = min(start + n, seq.num_prompt - 1) - start
        if m <= 0:
            continue
        first = last[i] - n + 1
        rows.append((i, start, m, k))
        at.extend(range(first, first + m))
        targets.extend(seq.token_ids[start + 1:start + 1 + m])
    if not rows:
        return []
    device, top = hidden.device, max(k for *_, k in rows)
    at_t, targets_t = torch.tensor(at, device=device), torch.tensor(targets, device=device)
    parts = [_score(model, hidden[at_t[s:s + SLICE_ROWS]], targets_t[s:s + SLICE_ROWS], top)
             for s in range(0, len(at), SLICE_ROWS)]
    lp, am, top_i, top_v = (torch.cat(t) if t[0] is not None else None for t in zip(*parts))
    chunks, o = [], 0
    for i, start, m, k in rows:
        ids = top_i[o:o + m, :k] if k else None
        vals = top_v[o:o + m, :k] if k else None
        chunks.append(PromptLogprobChunk(i, start, lp[o:o + m], am[o:o + m], ids, vals))
        o += m
    return chunks


def _score(model, hidden: torch.Tensor, targets: torch.Tensor, k: int):
    logits = model.raw_logits(hidden).float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    lp = logits.gather(1, targets[:, None]).squeeze(1) - lse.squeeze(1)
    am = logits.argmax(dim=-1)
    if not k:
        return lp, am, None, None
    top_v, top_i = logits.topk(k, dim=-1)
    return lp, am, top_i, top_v - lse
