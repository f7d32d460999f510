"""KVCache: the paged K/V tensors of every layer, laid out as the model's kernels want them, and their host
copy for swapped-out rows. The block pool (engine/core/block_pool.py) hands out block ids; this owns the
bytes behind them."""
from __future__ import annotations

import math
import mmap

import torch

from batchjob.kernels.modes import KvCacheDtype
from batchjob.kernels import bytes_per_token_head, quantized_kv_caches


class KVCache:
    def __init__(self, model, num_blocks: int, block_size: int, num_host_blocks: int = 0):
        c = model.config
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        kv = model.kv_cache_dtype
        if kv == KvCacheDtype.AUTO:
            k_shape, v_shape = model.kernels.kv_cache_shapes(num_blocks, block_size, c.num_kv_heads, c.head_dim)
            self.layers = [(_zeros(k_shape, model.dtype, model.device), _zeros(v_shape, model.dtype, model.device))
                           for _ in range(c.num_layers)]
        else:  # quantized (kernels/reference/kv_quant.py): codes and scales, each a paged tensor, in the kernels' layout
            bits = {"int8": 8, "int4": 4}[kv]
            alloc = lambda shape, dtype: _zeros(shape, dtype, model.device)  # noqa: E731
            make = getattr(model.kernels, "quantized_kv_caches", quantized_kv_caches)  # native lays its own out
            self.layers = [make(bits, num_blocks, block_size, c.num_kv_heads, c.head_dim, alloc)
                           for _ in range(c.num_layers)]
        # every paged tensor of a layer (K and V, or their codes and scales), with a host copy for swaps
        self.paged = [[t for cache in layer for t in _tensors(cache)] for layer in self.layers]
        pin = model.device.type == "cuda"
        # empty, not zeros: every host block is written by a swap-out before it is read, and untouched
        # pages cost no memory or start-up time
        self.host = [[torch.empty((num_host_blocks, math.prod(t.shape[1:])), dtype=t.dtype, pin_memory=pin)
                      for t in layer] for layer in self.paged] if num_host_blocks else None

    @staticmethod
    def bytes_per_block(model, block_size: int) -> int:
        """K and V bytes of one block over all layers (codes and scales for a quantized cache)."""
        c = model.config
        per = bytes_per_token_head(model.kv_cache_dtype, c.head_dim, model.dtype)
        return 2 * c.num_layers * block_size * c.num_kv_heads * per

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> int:
        """Copy preempted rows' blocks to the host pool, then swapped-in rows' blocks back. Returns bytes moved."""
        moved = 0
        for pairs, to_host in ((swap_out, True), (swap_in, False)):
            if not pairs:
                continue
            src = torch.tensor([a for a, _ in pairs], dtype=torch.long)
            dst = torch.tensor([b for _, b in pairs], dtype=torch.long)
            for layer, tensors in enumerate(self.paged):
                for j, cache in enumerate(tensors):
                    host = self.host[layer][j]
                    blocks = cache.view(cache.shape[0], -1)
                    if to_host:
                        host[dst] = blocks[src.to(cache.device)].to("cpu")
                    else:
                        blocks[dst.to(cache.device)] = host[src].to(cache.device, non_blocking=True)
            moved += len(pairs) * self.bytes_per_block(self.model, self.block_size)
        return moved


def _tensors(cache) -> tuple[torch.Tensor, ...]:
    return (cache,) if isinstance(cache, torch.Tensor) else cache.tensors()  # QuantizedKV or native PackedKV


def _zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that cost nothing until touched on the CPU: an anonymous mapping, whose pages the kernel maps as zero
    pages on first use, instead of torch.zeros' memset of the whole pool at start-up (most of a pool is never written
    by a short job). Not calloc (numpy's zeros): glibc serves a request below its mmap threshold from the heap and
    clears it there, and the threshold rises to 32 MB once a block that large is freed (loading weights frees
    many), so a pool of small layers was cleared whole at start-up after all: 2.9 ms for each 5 MB layer of a tiny
    job, 10% of the durability sweeps' time."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    # the tensor holds the mapping (its buffer) and unmaps it when the last view of it goes
    return torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8).view(dtype).view(shape)
