"""A job's "auto" choices made once, into a frozen ResolvedJob: the device, the compute dtype and the threads before
the model loads, and from the model's files the format its weight matmuls run in. `batchjob run` (job/run.py) and
the Python API (api.py) each build one and read these from it; nothing after them reads cfg.device, cfg.dtype or
cfg.threads again, or decides a model's quantization a second way."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchjob.device import choose_device, choose_dtype, dtype_name
from batchjob.job.options.modes import Quantization
from batchjob.job.options.options import JobConfig
from batchjob.job.process.threads import job_threads
from batchjob.kernels.quantization import keeps_fp8_codes, resolved_quantization
from batchjob.engine.tensor_parallel import ModelRequest, tensor_ranks
from batchjob.models.loader import LoadedModel, ModelDescription, check_split, describe_model, load_model


@dataclass(frozen=True, slots=True)
class ResolvedJob:
    config: JobConfig
    device: str  # "cpu" or "cuda": --device auto picks CUDA when torch sees a GPU
    dtype: torch.dtype  # --dtype auto: bf16 where the CPU computes in it natively (device.py), else fp32
    threads: int  # --threads 0: the CPUs this process may use (affinity, cgroup quota)

    @classmethod
    def of(cls, cfg: JobConfig) -> ResolvedJob:
        device = choose_device(cfg.device)
        threads = job_threads(cfg.threads)
        if cfg.tensor_parallel > 1 and device == "cpu":  # each rank computes on its share of the cores
            threads = max(1, threads // cfg.tensor_parallel)
        return cls(cfg, device, choose_dtype(cfg.dtype, device), threads)

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def keeps_fp8_codes(self) -> bool:
        """An fp8 checkpoint's weights stay fp8 codes (the device runs fp8 matmuls) instead of being widened at load."""
        return keeps_fp8_codes(self.config.quantization, self.device)

    @property
    def keeps_blocks(self) -> bool:
        """A GGUF file's block-quantized weights are computed as stored (--quantization auto on a CPU); `none`
        dequantizes them at load (the reference the quantized compute is measured against)."""
        return self.config.quantization == Quantization.AUTO and torch.device(self.device).type == "cpu"

    def load(self, source: str) -> LoadedModel:
        """A model's weights and tokenizer as this job computes with them (int8 codes kept for --quantization int8,
        GGUF blocks for auto on a CPU)."""
        world = self.config.tensor_parallel
        if world > 1:  # this process is rank 0: the other ranks start, and each loads its own slice
            check_split(source, world)
            ranks = tensor_ranks(world, self.device)
            ranks.request(ModelRequest(source, self.dtype_name, self.device, str(self.config.kernels),
                                       self.config.block_size, str(self.config.kv_cache_dtype)))
            return load_model(source, dtype=self.dtype, rank_of=(0, world))
        return load_model(source, dtype=self.dtype, int8_codes=self.config.quantization == Quantization.INT8,
                          fp8_codes=self.keeps_fp8_codes, blocks=self.keeps_blocks)

    def describe(self, source: str) -> ModelDescription:
        """The model's facts from its config and headers only (a job with nothing to compute loads no weights)."""
        return describe_model(source, fp8_codes=self.keeps_fp8_codes)

    def quantization(self, model: LoadedModel | ModelDescription) -> str:
        """The format a model's weight matmuls run in: --quantization against a pre-quantized checkpoint's own."""
        return resolved_quantization(self.config.quantization, model.quantization, model.quantization_scheme, model.name)
