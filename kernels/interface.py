"""The one paged interface every kernel backend takes (torch reference, native C++, Triton).

A step is described the way vLLM and FlashInfer describe it: the flat batch's rows (decodes first, one
query token each, then prompt chunks), each row's KV block table, its context length after this step
and the offsets of its query tokens in the batch. Backends read K/V through the block table; nothing
else (no slot matrices, masks or length groups) crosses the interface.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    block_tables: torch.Tensor  # int32 [rows, max_blocks]: KV block ids of each row (padding: 0)
    seq_lens: torch.Tensor  # int32 [rows]: context of each row after this step (cached + new tokens)
    query_start_loc: torch.Tensor  # int32 [rows + 1]: row r's new tokens are batch[query_start_loc[r]:query_start_loc[r+1]]
    slot_mapping: torch.Tensor  # int64 [tokens]: cache slot (block * block_size + offset) of each new token
    num_decodes: int  # rows 0..num_decodes-1 have one query token each
    plans: dict = field(default_factory=dict)  # per-backend work derived once per step, shared by every layer
    # host copies when the tensors live on a GPU (query_start_loc and seq_lens as lists, block_tables as a
    # CPU tensor): plans read these, never the device tensors (no sync inside the forward)
    host: dict | None = None
