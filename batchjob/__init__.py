"""batchjob: offline batch LLM inference with a continuous-batching engine and checkpoint-resume.

`batchjob.generate`, `chat`, `embed`, `score`, `run`, `LLM` and `Result` (batchjob/api.py), `LLMStage` (a Ray Data
stage: batchjob/ray/stage.py) and the errors a caller catches load on first use, so that `import batchjob` stays
light (no torch)."""
from __future__ import annotations

import importlib

from batchjob.errors import ChatHintWarning, ConfigError
from batchjob.version import __version__

_API = ("generate", "chat", "embed", "score", "run", "LLM", "Result", "Completion")
# the errors a caller catches, each where it is raised (some of those modules import torch)
_ERRORS = {
    "SourceError": "batchjob.io.sources.base",  # an input that cannot be read
    "ModelLoadError": "batchjob.errors",  # model files that cannot load
    "UnsupportedModelError": "batchjob.models.config",  # a model family or feature not supported
    "KernelError": "batchjob.kernels.dispatch",  # the kernels asked for cannot run here
    "KvBudgetError": "batchjob.errors",  # no room for a KV cache on the GPU
    "SinkError": "batchjob.io.recovery",  # an output folder that cannot take the results (held, another job)
    "TooManyErrors": "batchjob.job.error_budget",  # more rows failed than max_errors allows
    "AllRowsFailed": "batchjob.job.error_budget",  # every row failed
}
__all__ = ["__version__", *_API, "LLMStage", "ConfigError", "ChatHintWarning", *_ERRORS]


def __getattr__(name: str):
    if name in _API:
        from batchjob import api

        return getattr(api, name)
    if name == "LLMStage":
        return importlib.import_module("batchjob.ray.stage").LLMStage
    if name in _ERRORS:
        return getattr(importlib.import_module(_ERRORS[name]), name)
    raise AttributeError(f"module 'batchjob' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API, "LLMStage", *_ERRORS])
