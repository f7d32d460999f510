"""TorchKernels: the reference kernel set, one static method per op of the paged interface, on any device.
The compiled and Triton kernel sets are tested against it and fall back to it."""
from __future__ import annotations

import torch.nn.functional as F

from batchjob.kernels.reference.attention import paged_attention_torch, store_kv
from batchjob.kernels.reference.norm import rms_norm
from batchjob.kernels.reference.rotary import apply_rotary


class TorchKernels:
    """The references: caches [blocks, block_size, kv_heads, head_dim], SDPA over the gathered context."""
    name = "torch"

    @staticmethod
    def kv_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[tuple, tuple]:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return shape, shape

    @staticmethod
    def store_kv(k, v, k_cache, v_cache, slot_mapping):
        store_kv(k, v, k_cache, v_cache, slot_mapping)

    @staticmethod
    def attention(q, k_cache, v_cache, meta, scale, window=None, softcap=None):
        return paged_attention_torch(q, k_cache, v_cache, meta, scale, window, softcap)

    @staticmethod
    def rms_norm(x, weight, eps):
        return rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(x, residual, weight, eps):
        """residual += x (in place), then RMSNorm of it."""
        residual.add_(x)
        return rms_norm(residual, weight, eps)

    @staticmethod
    def prepare_rotary(rope, positions):
        return rope.table(positions)  # cos and sin rows of this step, shared by every layer

    @staticmethod
    def rotary(q, k, prepared):
        return apply_rotary(q, k, *prepared)

    @staticmethod
    def silu_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
