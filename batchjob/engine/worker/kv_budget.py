"""The KV pool's size, and how it was chosen (`KvPool`): blocks given, bytes given (--kv-cache-gb), on the
CPU by default what max_num_seqs rows of max_model_len tokens fill, up to a ceiling, and on CUDA vLLM's
rule: with the weights on the device, one profiling forward at the largest step the scheduler can build
(max_num_batched_tokens tokens over max_num_seqs rows, logits and sampling included) gives the activation
peak; the pool gets what is left of gpu_memory_utilization x the device's memory after that peak and what
the process holds outside torch's allocator (CUDA context, cuBLAS workspaces). The arithmetic is plain
(tested without CUDA); measuring needs a CUDA device."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchjob.engine.worker.model_runner import ModelRunner
from batchjob.engine.config import KvPool, KvSizing
from batchjob.engine.core.scheduler import SchedulerConfig, Step
from batchjob.engine.core.scheduler_output import WorkerView
from batchjob.engine.params import SamplingParams
from batchjob.engine.core.sequence import Sequence, SeqStatus
from batchjob.errors import KvBudgetError  # noqa: F401 - raised here, defined with the other errors

GIB = 1 << 30


def rows_blocks(rows: int, row_tokens: int, block_size: int, watermark: int = 0) -> int:
    """Blocks for `rows` rows of `row_tokens` tokens each, plus the scheduler's watermark."""
    return rows * -(-row_tokens // block_size) + watermark


def pool_size(model, config, per_block: int) -> KvPool:
    """The KV pool for `model` under an EngineConfig: `num_blocks` if given; on CUDA with
    gpu_memory_utilization, what the device has left (gpu_kv_blocks); else `kv_cache_bytes`, or with
    `kv_cache_fit_rows` (the CPU default) no more than the job's rows can use: max_num_seqs rows at
    max_model_len (the model's context) each, with `kv_cache_bytes` as the ceiling. Unused pages of a CPU
    pool cost nothing until a row writes them (kv_cache.py), but a long job writes them all, so the pool is
    never larger than the rows can fill."""
    bs = config.block_size
    if config.num_blocks:
        return KvPool(config.num_blocks, bs, per_block, KvSizing.BLOCKS)
    if config.gpu_memory_utilization and model.device.type == "cuda":
        return KvPool(gpu_kv_blocks(model, config, per_block), bs, per_block, KvSizing.GPU)
    blocks = max(2, config.kv_cache_bytes // per_block)
    if not config.kv_cache_fit_rows:
        return KvPool(blocks, bs, per_block, KvSizing.BYTES)
    sched = config.scheduler or SchedulerConfig()
    rows = sched.static_batch or sched.max_num_seqs
    row_tokens = min(sched.max_model_len, model.config.max_position_embeddings)
    wanted = rows_blocks(rows, row_tokens, bs, sched.watermark_blocks)
    if wanted <= blocks:
        return KvPool(max(2, wanted), bs, per_block, KvSizing.ROWS, rows, row_tokens)
    return KvPool(blocks, bs, per_block, KvSizing.CEILING, rows, row_tokens)


@dataclass(slots=True, frozen=True)
class DeviceMemory:
    total: int  # bytes on the device
    free: int  # free before the profiling forward (other processes and this one's weights already counted)
    torch_reserved: int  # held by torch's caching allocator before the profiling forward (the weights)
    peak_allocated: int  # torch's peak allocation during the profiling forward (weights included)


def kv_cache_bytes(mem: DeviceMemory, utilization: float) -> int:
    """Bytes for the KV pool: utilization x total, less this process's peak (weights + activations) and
    what is used outside torch's allocator (other processes, the CUDA context)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(mem.total * utilization)
    outside_torch = (mem.total - mem.free) - mem.torch_reserved  # other processes + the CUDA context
    left = budget - outside_torch - mem.peak_allocated
    if left <= 0:
        raise KvBudgetError(
            f"no room for a KV cache: {utilization:.0%} of the GPU's {mem.total / GIB:.1f} GiB is "
            f"{budget / GIB:.1f} GiB, and the weights with the largest step's activations take "
            f"{mem.peak_allocated / GIB:.1f} GiB, other memory (CUDA context, other processes) "
            f"{outside_torch / GIB:.1f} GiB: raise --gpu-memory-utilization, lower --max-num-batched-tokens "
            "or --max-num-seqs, or use a smaller model or dtype")
    return left


def blocks_for(nbytes: int, bytes_per_block: int, min_blocks: int) -> int:
    blocks = nbytes // bytes_per_block
    if blocks < min_blocks:
        raise KvBudgetError(f"the KV cache fits {blocks} blocks, fewer than the {min_blocks} one full-length row "
                            "needs: raise --gpu-memory-utilization or lower --max-num-batched-tokens / --max-model-len")
    return blocks


def profile_step(max_tokens: int, max_rows: int, block_size: int) -> tuple[Step, int]:
    """The largest step the scheduler can build: `max_tokens` prompt tokens spread over `max_rows` rows
    (token id 0, block tables laid out one after another). Returns the step and the blocks it uses."""
    rows = max(1, min(max_rows, max_tokens))
    step, next_block = Step(), 0
    for i in range(rows):
        n = max_tokens // rows + (1 if i < max_tokens % rows else 0)
        seq = Sequence(i, [0] * n, SamplingParams(max_tokens=1))
        need = -(-n // block_size)
        seq.block_table = list(range(next_block, next_block + need))
        seq.status = SeqStatus.RUNNING
        next_block += need
        step.seqs.append(seq)
        step.num_new.append(n)
    return step, next_block


def measure_cuda(run_profile, device: torch.device) -> DeviceMemory:
    """Runs `run_profile()` (the profiling forward) and reads the device's memory around it."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    return DeviceMemory(total=total, free=free, torch_reserved=reserved, peak_allocated=peak)


def gpu_kv_blocks(model, config, per_block: int) -> int:
    """KV blocks for what the GPU has left after the weights and one forward at the largest step."""
    sched = config.scheduler or SchedulerConfig()
    max_len = min(sched.max_model_len, model.config.max_position_embeddings)
    tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * max_len)
    step, used = profile_step(tokens, sched.max_num_seqs, config.block_size)
    runner = ModelRunner(model, used, config.block_size)  # a KV cache just large enough for the profile
    mem = measure_cuda(lambda: runner.run(WorkerView().output(step)), model.device)
    del runner  # its KV cache was counted in the peak: it is free again
    nbytes = kv_cache_bytes(mem, config.gpu_memory_utilization) + used * per_block
    return blocks_for(nbytes, per_block, min_blocks=-(-max_len // config.block_size))
