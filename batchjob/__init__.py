"""batchjob: offline batch LLM inference with a continuous-batching engine and checkpoint-resume.

`batchjob.generate`, `batchjob.run`, `batchjob.LLM` and `batchjob.Result` (batchjob/api.py) load on
first use, so that `import batchjob` stays light (no torch)."""
from __future__ import annotations

from batchjob.version import __version__

_API = ("generate", "run", "LLM", "Result", "Completion")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from batchjob import api

        return getattr(api, name)
    raise AttributeError(f"module 'batchjob' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
