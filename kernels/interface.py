"""The one paged interface every kernel backend takes (torch reference, native C++, Triton).

A step is described the way vLLM and FlashInfer describe it: the flat batch's rows (decodes first, one
query token each, then prompt chunks), each row's KV block table, its context length after this step
and the offsets of its query tokens in the batch. Backends read K/V through the block table; nothing
else (no slot matrices, masks or length groups) crosses the interface.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchjob.kernels.reference import elementwise
from batchjob.kernels.reference import lora as reference_lora
from batchjob.kernels.reference import norm as reference_norm
from batchjob.kernels.reference import rotary as reference_rotary


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
    # int32 [tokens] or None: the key position (exclusive) each query token sees up to, where it is past the token
    # itself (a token of a Gemma 3 image sees its whole image: bidirectional runs of one row's prompt, computed in
    # one step); None, or a value <= the token's position + 1: causal. Decodes are always causal.
    key_ends: torch.Tensor | None = None


class KernelSet:
    """The ops a model runs with, one method each; `kernels/dispatch.py` chooses the set.

    The layout ops (`kv_cache_shapes`, `store_kv`, `attention`) go together: the cache layout belongs to the
    attention kernel, so every backend defines all three. The elementwise ops default to the torch
    references (kernels/reference/), so a backend that lacks one runs the reference for that op alone;
    `reference_ops()` names them and dispatch logs them once.
    """

    name: str = "?"
    captures_graphs: bool = False  # graph_plan gives plans from shapes alone (CUDA graphs can capture a step)
    ELEMENTWISE_OPS = ("rms_norm", "add_rms_norm", "rotary", "silu_mul", "gelu_tanh_mul", "softcap", "argmax")

    # -- the cache layout and attention (no default: they go with the backend's cache layout)

    def kv_cache_shapes(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[tuple, tuple]:
        raise NotImplementedError

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache, v_cache, slot_mapping: torch.Tensor) -> None:
        """k, v [T, Hkv, D] (rows may be strided) into their slots of the caches."""
        raise NotImplementedError

    def attention(self, q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                  window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q [T, H, D] (rotated; their K/V already stored) -> [T, H, D]. `window`: this layer's sliding window;
        `softcap`: logits become tanh(s / cap) * cap before the softmax (Gemma 2)."""
        raise NotImplementedError

    def graph_plan(self, max_context: int) -> dict:
        """Per-step attention plans from shapes alone, for CUDA graphs (where `captures_graphs`)."""
        raise NotImplementedError(f"the {self.name} kernels plan each step on the host: no CUDA graphs")

    # -- elementwise ops: the references unless the backend has its own

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return reference_norm.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place), then RMSNorm of it."""
        residual.add_(x)
        return reference_norm.rms_norm(residual, weight, eps)

    def prepare_rotary(self, rope, positions: torch.Tensor):
        """What `rotary` takes for this step, shared by every layer (a pair with `rotary`)."""
        return rope.table(positions)

    def lora(self, x: torch.Tensor, y: torch.Tensor, weights, slots: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """y (a projection's base output for x) + each token's own adapter's `(x A^T) B^T` (kernels/reference/lora.py):
        `weights` a LoraWeights, `slots` int32 [T] (-1: none), `keep` [T, slots] their one-hot. The CPU path (one
        stacked shrink and expand with row-count-invariant matmuls) unless the backend has kernels of its own."""
        return reference_lora.lora_stacked(x, y, weights, keep)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, prepared) -> tuple[torch.Tensor, torch.Tensor]:
        return reference_rotary.apply_rotary(q, k, *prepared)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return elementwise.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return elementwise.gelu_tanh_mul(gate_up)

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        return elementwise.softcap(x, cap)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits.argmax(-1)` of [rows, vocab] logits: the same indices (first maximum; NaN the maximum)."""
        return elementwise.argmax_rows(logits)

    @property
    def label(self) -> str:
        """How the start line names these kernels (the native ones add their instruction set: "native AVX2")."""
        return self.name

    def reference_ops(self) -> list[str]:
        """The elementwise ops this set takes from the torch references (none of its own)."""
        mine = type(self)
        return [op for op in self.ELEMENTWISE_OPS if getattr(mine, op) is getattr(KernelSet, op)]
