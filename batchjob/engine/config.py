"""What the engine is built with, for its callers: `EngineConfig` (the KV pool, prefix caching, CUDA graphs,
speculation) around a `SchedulerConfig` (budgets, admission, preemption, lanes), and the modes they take.
The job builds these from its options (job/engine_setup.py); nothing outside engine/ reads the modules that
define them."""
from __future__ import annotations

from dataclasses import dataclass

from batchjob.engine.core.lanes import Lane
from batchjob.engine.core.scheduler import Admission, Preemption, SchedulerConfig
from batchjob.engine.spec_decode.config import SpeculativeConfig, SpeculativeError, SpeculativeMethod, speculative_config

__all__ = ["Admission", "EngineConfig", "Lane", "Preemption", "SchedulerConfig", "SpeculativeConfig", "SpeculativeError",
           "SpeculativeMethod", "speculative_config"]


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 0  # 0 = derive from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30
    gpu_memory_utilization: float | None = None  # on CUDA: size the pool from the device's memory (kv_budget.py)
    swap_space_bytes: int = 0  # host pool for preemption=swap|auto
    num_host_blocks: int = 0  # 0 = derive from swap_space_bytes
    enable_prefix_caching: bool = True
    # schedule and launch step N+1 before collecting step N (Engine.step); None: on CUDA only (a CPU forward
    # has finished when it returns: nothing to overlap)
    async_scheduling: bool | None = None
    cuda_graphs: bool = True  # on CUDA with graph-capable kernels (Triton): decode steps replay CUDA graphs
    speculative: SpeculativeConfig | None = None  # speculative decoding (engine/spec_decode/ngram.py); None: off
    scheduler: SchedulerConfig | None = None
