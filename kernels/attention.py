"""Paged KV cache ops: write new keys/values into cache slots, and attention over block tables.

The flattened batch holds decode tokens first (one per decoding row, shortest context first), then
the prompt chunks of prefilling rows. Decodes attend as a few batched [rows, 1, ctx] problems, each
group of rows padded to its own longest context; prompt chunks as one batched
[rows, chunk, ctx] problem with a causal mask offset by what each row already has cached. Masks and
gather indices are built once per step by the model runner and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) of each new token
    num_decode_tokens: int  # the first tokens of the batch are decodes, one per row
    # decode rows in groups of similar context length: (first, end, slots [n, L] (pad -> slot 0),
    # mask [n, 1, 1, L] bool, True = attend), L the group's longest context
    decode_groups: list[tuple[int, int, torch.Tensor, torch.Tensor]] | None = None
    prefill_slots: torch.Tensor | None = None  # [Sp, Lp]
    prefill_mask: torch.Tensor | None = None  # [Sp, 1, Qmax, Lp] bool
    prefill_gather: torch.Tensor | None = None  # [Sp, Qmax] token index into the batch (pad -> 0)
    prefill_valid: torch.Tensor | None = None  # [Sp, Qmax] bool


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # k_cache: [num_blocks, block_size, Hkv, D]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    # [S, L] slots -> [S, Hkv, L, D]; index_select on flat token rows is several times faster than
    # advanced indexing by block on CPU
    s, length = slots.shape
    hkv, d = cache.shape[2], cache.shape[3]
    kv = cache.view(-1, hkv * d).index_select(0, slots.view(-1))
    return kv.view(s, length, hkv, d).transpose(1, 2)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q: [T, H, D] (new tokens, already rotated; their K/V already stored). Returns [T, H, D]."""
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    for a, b, slots, mask in meta.decode_groups if nd else ():
        k = _gather(k_cache, slots)
        v = _gather(v_cache, slots)
        o = F.scaled_dot_product_attention(q[a:b].unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[a:b] = o.squeeze(2)
    if meta.prefill_gather is not None:
        k = _gather(k_cache, meta.prefill_slots)
        v = _gather(v_cache, meta.prefill_slots)
        qp = q[meta.prefill_gather].transpose(1, 2)  # [Sp, H, Qmax, D]
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=meta.prefill_mask, scale=scale, enable_gqa=True)
        out[meta.prefill_gather[meta.prefill_valid]] = o.transpose(1, 2)[meta.prefill_valid]
    return out
