"""What the engine is built with, for its callers: `EngineConfig` (the KV pool, prefix caching, CUDA graphs,
speculation) around a `SchedulerConfig` (budgets, admission, preemption, lanes), and the modes they take; and the
KV pool it got (`KvPool`: its size and how it was chosen, engine/worker/kv_budget.py).
The job builds these from its options (job/engine_setup.py); nothing outside engine/ reads the modules that
define them."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from batchjob.engine.core.lanes import Lane
from batchjob.engine.core.scheduler import Admission, Preemption, SchedulerConfig
from batchjob.engine.spec_decode.config import SpeculativeConfig, SpeculativeError, SpeculativeMethod, speculative_config

__all__ = ["Admission", "EngineConfig", "KvPool", "KvSizing", "Lane", "Preemption", "SchedulerConfig", "SpeculativeConfig", "SpeculativeError",
           "SpeculativeMethod", "speculative_config"]


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 0  # 0 = derive from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30
    # the CPU default: no more blocks than max_num_seqs rows of max_model_len tokens fill, kv_cache_bytes the
    # ceiling (engine/worker/kv_budget.py: pool_size)
    kv_cache_fit_rows: bool = False
    gpu_memory_utilization: float | None = None  # on CUDA: size the pool from the device's memory (kv_budget.py)
    swap_space_bytes: int = 0  # host pool for preemption=swap|auto
    num_host_blocks: int = 0  # 0 = derive from swap_space_bytes
    enable_prefix_caching: bool = True
    # schedule and launch step N+1 before collecting step N (Engine.step); None: on CUDA only (a CPU forward
    # has finished when it returns: nothing to overlap)
    async_scheduling: bool | None = None
    cuda_graphs: bool = True  # on CUDA with graph-capable kernels (Triton): decode steps replay CUDA graphs
    speculative: SpeculativeConfig | None = None  # speculative decoding (engine/spec_decode/ngram.py); None: off
    # image encoder outputs kept by image digest across rows, in placeholder tokens (engine/worker/encoder.py
    # EncoderCache): a picture several rows ask about is encoded once; 0: off
    encoder_cache_tokens: int = 16384
    scheduler: SchedulerConfig | None = None


class KvSizing(StrEnum):
    """How the pool's size was chosen."""
    BLOCKS = "blocks"  # a number of blocks given (tests, benches)
    BYTES = "bytes"  # a number of bytes given (--kv-cache-gb)
    ROWS = "rows"  # the CPU default: every row max_num_seqs allows at its longest (max_model_len or the context)
    CEILING = "ceiling"  # the CPU default when those rows would take more: the ceiling's bytes
    GPU = "gpu"  # what gpu_memory_utilization leaves on the device after the weights and the largest step


@dataclass(slots=True, frozen=True)
class KvPool:
    """The pool the engine got: its blocks and their bytes, and how its size was chosen."""
    blocks: int
    block_size: int
    bytes_per_block: int  # K and V over every layer (and a draft model's share)
    sizing: KvSizing
    rows: int = 0  # ROWS and CEILING: max_num_seqs (a static batch's size)
    row_tokens: int = 0  # ROWS and CEILING: a row's most tokens (max_model_len, else the model's context)

    @property
    def nbytes(self) -> int:
        return self.blocks * self.bytes_per_block

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def rows_bytes(self) -> int:
        """ROWS and CEILING: what every row at its longest would take (more than the pool, for CEILING)."""
        return self.rows * -(-self.row_tokens // self.block_size) * self.bytes_per_block
