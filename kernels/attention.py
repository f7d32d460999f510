"""Paged KV cache ops: write new keys/values into cache slots, and attention over block tables.

The flattened batch holds decode tokens first (one per decoding row, shortest context first), then
the prompt chunks of prefilling rows. Decodes attend as a few batched [rows, 1, ctx] problems, each
group of rows padded to its own longest context; fresh prompts as a few batched causal [rows, chunk,
chunk] problems (no mask: SDPA skips the upper triangle), and chunks that continue a row as one batched
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
    # prompt chunks in groups: (gather [n, Qmax] token index into the batch (pad -> 0), valid [n, Qmax] bool,
    # slots [n, L], mask [n, 1, Qmax, L] bool or None = plain causal (rows that start at position 0, L == Qmax))
    prefill_groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] | None = None


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
    for gather, valid, slots, mask in meta.prefill_groups or ():
        k = _gather(k_cache, slots)
        v = _gather(v_cache, slots)
        qp = q[gather].transpose(1, 2)  # [n, H, Qmax, D]
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
        out[gather[valid]] = o.transpose(1, 2)[valid]
    return out
