"""TorchKernels: the reference kernel set, on any device: the reference cache layout and attention, and every
elementwise op from KernelSet's defaults (the references themselves). The compiled and Triton kernel sets
are tested against it."""
from __future__ import annotations

from batchjob.kernels.interface import KernelSet
from batchjob.kernels.reference.attention import paged_attention_torch, store_kv


class TorchKernels(KernelSet):
    """The references: caches [blocks, block_size, kv_heads, head_dim], SDPA over the gathered context.
    `per_row`: attention one row at a time, batch-invariant (what an engine on the CPU runs, kernels/dispatch.py)."""
    name = "torch"

    def __init__(self, per_row: bool = False):
        self.per_row = per_row

    def kv_cache_shapes(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[tuple, tuple]:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return shape, shape

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        store_kv(k, v, k_cache, v_cache, slot_mapping)

    def attention(self, q, k_cache, v_cache, meta, scale, window=None, softcap=None):
        return paged_attention_torch(q, k_cache, v_cache, meta, scale, window, softcap, self.per_row)

    def reference_ops(self) -> list[str]:
        return []  # all of them, by definition: nothing to report
