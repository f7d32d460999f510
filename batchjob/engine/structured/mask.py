"""Applying an int32 next-token bitmask to logits in place: disallowed tokens -> -inf, the rest untouched.

Bit t % 32 of word t // 32 allows token t (llguidance's layout). The words are read as little-endian bytes, each
byte looks up its 8 upper bounds (+inf: allowed, -inf: not) in a 256 x 8 table, and `torch.minimum(logits,
bound)` writes the result: two passes with no branch per element. masked_fill_ with the unpacked bits is the
reference (tests/engine/test_structured.py); for every logit that is not NaN the result is bit-identical to it
(min(x, +inf) is x, -0.0 included); a NaN logit stays NaN. Runs on any device the logits are on (the bitmask is
copied there). 64 x 49,152 fp32 on 2 busy CPU cores: ~1.2 ms, against ~13 ms for masked_fill_ with a bool mask.
"""
from __future__ import annotations

import sys
from functools import lru_cache

import torch

if sys.byteorder != "little":  # the byte view below reads word bits 0-7 from the word's first byte
    raise ImportError("batchjob.engine.structured.mask assumes a little-endian host")

_CHUNK_ELEMENTS = 1 << 23  # rows per pass so the bound tensor stays <= 8M logits (32 MiB in fp32)


@lru_cache(maxsize=16)
def _byte_bounds(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: row b holds, for bit k of byte b, +inf when set and -inf when clear."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(bits.bool(), float("inf"), float("-inf")).to(dtype=dtype, device=device)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None) -> None:
    """logits: [rows, vocab] fp32/bf16/fp16, changed in place. bitmask: int32 [n, words] with 32 * words >= vocab
    (bits past vocab are ignored). indices: the logits row of each bitmask row (n of them, distinct); None: the
    bitmask has one row per logits row."""
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"apply_token_bitmask_: need logits [rows, vocab] and an int32 bitmask [rows, words], got "
                         f"{tuple(logits.shape)} and {bitmask.dtype} {tuple(bitmask.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"apply_token_bitmask_: logits must be floating point, got {logits.dtype}")
    vocab = logits.shape[1]
    if 32 * bitmask.shape[1] < vocab:
        raise ValueError(f"apply_token_bitmask_: {bitmask.shape[1]} words cover {32 * bitmask.shape[1]} tokens, "
                         f"the logits have {vocab}")
    expected = logits.shape[0] if indices is None else indices.numel()
    if bitmask.shape[0] != expected:
        raise ValueError(f"apply_token_bitmask_: {bitmask.shape[0]} bitmask rows for {expected} logits rows")
    if expected == 0:
        return
    bitmask = bitmask.to(logits.device, non_blocking=True).contiguous()
    bounds = _byte_bounds(logits.dtype, logits.device)
    step = max(1, _CHUNK_ELEMENTS // (bitmask.shape[1] * 32))
    if indices is not None:
        indices = indices.to(logits.device)
    for start in range(0, bitmask.shape[0], step):
        words = bitmask[start:start + step]
        n = words.shape[0]
        upper = bounds.index_select(0, words.view(torch.uint8).reshape(-1).to(torch.int32)).view(n, -1)[:, :vocab]
        if indices is None:
            rows = logits[start:start + n]
            torch.minimum(rows, upper, out=rows)
        else:
            idx = indices[start:start + n]
            logits.index_copy_(0, idx, torch.minimum(logits.index_select(0, idx), upper))


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab]: True where the bitmask allows the token (the plain shift-and-test, for checks)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
