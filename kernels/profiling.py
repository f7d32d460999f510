"""Named scopes for torch.profiler around the model's op groups (attention, norms, matmuls, ...), so a
profile of a step says where the time goes even for kernels torch cannot see into (the native ones).
Free when no profiler runs: `scope` returns a shared no-op context."""
from __future__ import annotations

import contextlib

import torch
from torch.autograd import profiler as _profiler

_NOTHING = contextlib.nullcontext()


def scope(name: str):
    return torch.profiler.record_function(name) if _profiler._is_profiler_enabled else _NOTHING
