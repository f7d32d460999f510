"""The engine a job config asks for (the model with its kernels, the scheduler's lanes and budgets, the KV
cache), built the same way for `batchjob run` and for the Python API."""
from __future__ import annotations

from batchjob.job.options.config import JobConfig
from batchjob.job.options.modes import AsyncScheduling, Preemption, Scheduling, SpeculativeMethod
from batchjob.job.options.resolved import ResolvedJob
from batchjob.engine.config import EngineConfig, Lane, SchedulerConfig, speculative_config
from batchjob.engine.engine import Engine
from batchjob.lora.adapter import read_adapters
from batchjob.lora.apply import AdapterSet, slots_of
from batchjob.models.causal_lm import CausalLM
from batchjob.models.registry import build_model
from batchjob.engine.tensor_parallel import tensor_ranks
from batchjob.models.tensor_parallel import RankGroup
from batchjob.models.loader import LoadedModel, ModelLoadError


CPU_KV_CEILING_GB = 1.0  # the CPU's default KV pool is at most this (what the job's rows can fill, if less)
# the default token budget of a step: a CPU's like llama.cpp's micro-batch (measured on a 1B-class Q4_K_M, 32 x (128 +
# 64): as fast as 2048 and 0.1-0.2 GiB less peak memory; SmolLM2 the same either way), CUDA's vLLM's
DEFAULT_STEP_TOKENS = {"cpu": 512, "cuda": 2048}


def step_tokens(cfg: JobConfig, device: str) -> int:
    """max_num_batched_tokens as given, else the device's default."""
    return cfg.max_num_batched_tokens or DEFAULT_STEP_TOKENS.get(device, 2048)


def lanes_of(cfg: JobConfig) -> list[Lane]:
    if not cfg.lanes:
        return [Lane()]
    return [Lane(lane["name"], lane.get("priority", 0), float(lane.get("weight", 1.0))) for lane in cfg.lanes]


def build_engine(job: ResolvedJob, loaded: LoadedModel) -> Engine:
    """The model (which takes the loaded weights: loaded.weights is empty after) and its engine."""
    return engine_for(job.config, loaded, *build_models(job, loaded))


def build_models(job: ResolvedJob, loaded: LoadedModel) -> tuple[CausalLM, CausalLM | None]:
    """The model and, for `--speculative draft`, the draft model; the model takes loaded.weights."""
    cfg, dtype, device = job.config, job.dtype, job.device
    adapters = AdapterSet.of(read_adapters(cfg.adapters, cfg.max_lora_rank)) if cfg.adapters else None
    shard = loaded.shard  # a tensor-parallel rank's slice (this process is rank 0): built as the others build theirs
    model = build_model(loaded.config if shard is None else shard.shard_config(), loaded.weights, dtype, device,
                        kernels=cfg.kernels, block_size=cfg.block_size, kv_cache_dtype=cfg.kv_cache_dtype,
                        quantization=job.quantization(loaded), prequantized=loaded.prequantized, adapters=adapters,
                        parallel=None if shard is None else RankGroup(shard, tensor_ranks(shard.world, device).lost))
    draft = None
    if cfg.speculative == SpeculativeMethod.DRAFT:
        try:
            proposer = job.load(cfg.draft_model)
        except ModelLoadError as e:
            raise ModelLoadError(f"--draft-model: {e}") from None
        if proposer.tokenizer.vocab_size != loaded.tokenizer.vocab_size:
            raise ModelLoadError(f"draft model {cfg.draft_model}: its tokenizer has {proposer.tokenizer.vocab_size:,} "
                                 f"tokens, the target's {loaded.tokenizer.vocab_size:,}; a draft model must share the "
                                 "target's tokenizer (e.g. a smaller model of the same family)")
        draft = build_model(proposer.config, proposer.weights, dtype, device, kernels=cfg.kernels,
                            block_size=cfg.block_size, kv_cache_dtype=cfg.kv_cache_dtype,
                            quantization=job.quantization(proposer), prequantized=proposer.prequantized)
    return model, draft


def engine_for(cfg: JobConfig, loaded: LoadedModel, model: CausalLM, draft: CausalLM | None = None) -> Engine:
    """An engine around built models (a fresh one for models that served an engine before: its KV cache,
    scheduler and grammars are new)."""
    static = cfg.scheduling == Scheduling.STATIC
    sched = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs, prefill_chunk=cfg.prefill_chunk,
        # a static batch is prefilled whole, then decoded until its longest row ends
        max_num_batched_tokens=1 << 20 if static else step_tokens(cfg, model.device.type),
        static_batch=cfg.batch_size if static else 0, admission=cfg.admission, preemption=cfg.preemption,
        max_wait=cfg.max_wait, lanes=lanes_of(cfg), max_loras=cfg.max_loras,
        max_num_encoder_tokens=cfg.max_num_encoder_tokens,
        **({"max_model_len": cfg.max_model_len} if cfg.max_model_len else {}),  # else the model's context
    )
    # --kv-cache-gb wins; else on the CPU what max_num_seqs rows of max_model_len tokens fill, at most
    # CPU_KV_CEILING_GB, and on CUDA what gpu_memory_utilization leaves (engine/worker/kv_budget.py)
    ecfg = EngineConfig(block_size=cfg.block_size, kv_cache_bytes=int((cfg.kv_cache_gb or CPU_KV_CEILING_GB) * (1 << 30)),
                        kv_cache_fit_rows=cfg.kv_cache_gb is None,
                        gpu_memory_utilization=cfg.gpu_memory_utilization if cfg.kv_cache_gb is None else None,
                        swap_space_bytes=int(cfg.swap_space_gb * (1 << 30)) if cfg.preemption != Preemption.RECOMPUTE else 0,
                        enable_prefix_caching=cfg.prefix_caching, cuda_graphs=cfg.cuda_graphs,
                        encoder_cache_tokens=cfg.encoder_cache_tokens,
                        async_scheduling=AsyncScheduling(cfg.async_scheduling).engine_value,
                        speculative=speculative_config(cfg.speculative, cfg.num_speculative_tokens, cfg.speculative_max_rows,
                                                       cfg.draft_model),
                        scheduler=sched)
    return Engine(model, loaded.tokenizer.eos_token_ids, ecfg, draft_model=draft, tokenizer=loaded.tokenizer)


def adapter_slots(cfg: JobConfig) -> dict[str, int] | None:
    """The job's LoRA adapters by name -> their slot on the model (as build_models puts them on it), or None."""
    return slots_of(list(cfg.adapters)) if cfg.adapters else None
