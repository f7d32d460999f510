"""The modes a job's options take, as enums: those a layer below owns (kernels, quantized formats, the scheduler's
admission and preemption, speculation, pooling, part files) named here beside the job's own. Each is a `StrEnum`:
its members are the strings a job file or a flag gives, so a value compares, prints and serialises as its text."""
from __future__ import annotations

from enum import StrEnum

from batchjob.engine.config import Admission, Preemption, SpeculativeMethod
from batchjob.engine.requests import Pooling
from batchjob.io.part_format import PartFormat
from batchjob.kernels.modes import KernelChoice, KvCacheDtype, Quantization

__all__ = ["Admission", "AsyncScheduling", "Device", "Dtype", "KernelChoice", "KvCacheDtype", "OutputFormat",
           "PartFormat", "Pooling", "Preemption", "Quantization", "Scheduling", "SpeculativeMethod", "Task"]


class Task(StrEnum):
    """What each row is run for: text (generate), a pooled embedding (embed) or its prompt's logprobs (score);
    embed and score rows are one prefill each."""
    GENERATE = "generate"
    EMBED = "embed"
    SCORE = "score"

    @property
    def prefill_only(self) -> bool:
        return self is not Task.GENERATE


class Dtype(StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class Device(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


class Scheduling(StrEnum):
    """Continuous batching, or classic static batching for comparison."""
    CONTINUOUS = "continuous"
    STATIC = "static"


class AsyncScheduling(StrEnum):
    """Schedule step N+1 while step N runs: auto (on CUDA), on or off."""
    AUTO = "auto"
    ON = "on"
    OFF = "off"

    @property
    def engine_value(self) -> bool | None:
        return {AsyncScheduling.AUTO: None, AsyncScheduling.ON: True, AsyncScheduling.OFF: False}[self]


class OutputFormat(StrEnum):
    """Arrow parts only, or OpenAI Batch results.jsonl and errors.jsonl beside them at the end."""
    ARROW = "arrow"
    OPENAI_BATCH = "openai-batch"
