"""The Triton kernel set for the GPU path, one kernel per torch reference, over the same paged interface.

Must equal: kernels/reference/attention.py (store_kv, paged_attention_torch with its window and softcap),
kernels/reference/norm.py (rms_norm), kernels/reference/rotary.py (apply_rotary) and kernels/reference/elementwise.py
(silu_mul, gelu_tanh_mul, softcap) and kernels/reference/lora.py (lora_shrink, lora_expand); argmax stays the reference's (KernelSet's default). Tested by
tests/kernels/test_triton_kernels.py under the interpreter (TRITON_INTERPRET=1, fp32 and fp16: the interpreter
computes bf16 on raw bits); on CUDA the same cases run by `python -m tests.kernels.triton_cases --device cuda`.
Every kernel loads its inputs, computes in fp32 and casts only at the store.

The KV cache keeps the reference layout, [blocks, block_size, kv_heads, head_dim], so a Triton step and
a torch step read the same cache. Decode attention packs the query heads of one KV head into one tile
(GQA: each K/V block is read once per KV head) and splits long contexts into fixed 512-token pieces
merged by log-sum-exp in split order: a row's result never depends on the batch beside it.
"""
from __future__ import annotations

import os

import torch

from batchjob.kernels.interface import KernelSet
from batchjob.kernels.triton import attention as triton_attention
from batchjob.kernels.triton import elementwise as triton_elementwise
from batchjob.kernels.triton import lora as triton_lora
from batchjob.kernels.triton.attention import triton


def available(device: torch.device) -> str | None:
    """None when the Triton kernels can run on `device`, else why not."""
    if triton is None:
        return "triton is not installed"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"Triton kernels run on CUDA (or on the CPU under TRITON_INTERPRET=1), not on {device.type}"


class TritonKernels(KernelSet):
    """The Triton kernel set (kernels/dispatch.py): the reference cache layout, Triton everywhere else
    (kernels/triton/attention.py, kernels/triton/elementwise.py)."""

    name = "triton"
    captures_graphs = True

    def __init__(self, head_dim: int, gqa: int, dtype: torch.dtype, block_size: int):
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size {block_size}: the Triton kernels need a power of two >= 16")
        self.head_dim, self.gqa, self.dtype, self.block_size = head_dim, gqa, dtype, block_size

    def kv_cache_shapes(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[tuple, tuple]:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return shape, shape

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        triton_attention.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def attention(self, q, k_cache, v_cache, meta, scale, window=None, softcap=None):
        return triton_attention.attention(q, k_cache, v_cache, meta, scale, self.block_size, window, softcap)

    def lora(self, x, y, weights, slots, keep):
        return triton_lora.lora_expand(y, triton_lora.lora_shrink(x, weights.a, slots), weights.b, slots)

    def graph_plan(self, max_context: int) -> dict:
        """Decode plans from shapes alone, for CUDA graphs (batchjob/engine/worker/cuda_graphs.py)."""
        return {"triton": triton_attention.decode_plan(max_context)}

    def rms_norm(self, x, weight, eps):
        return triton_elementwise.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return triton_elementwise.add_rms_norm(x, residual, weight, eps)

    def rotary(self, q, k, prepared):
        return triton_elementwise.rotary(q, k, prepared)

    def silu_mul(self, gate_up):
        return triton_elementwise.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up):
        return triton_elementwise.gelu_tanh_mul(gate_up)

    def softcap(self, x, cap):
        return triton_elementwise.softcap(x, cap)

    def prepare_rotary(self, rope, positions):
        return rope.cos, rope.sin, positions
