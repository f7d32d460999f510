"""Model ops over one paged interface (interface.py). Attention, KV store, norms, rotary and SiLU each have a
torch reference (reference/: the test oracle and the fallback), a compiled CPU kernel (native/csrc/, built at
first use) and a Triton kernel (triton/); weight matmuls are linear.py's. `dispatch.select_kernels` chooses.
The names below load on first use, so that naming a mode (modes.py) imports no torch."""
from __future__ import annotations

import importlib

_HOMES = {"AttentionMetadata": "interface", "KernelSet": "interface", "paged_attention_torch": "reference.attention",
          "store_kv": "reference.attention", "CHOICES": "dispatch", "KernelError": "dispatch",
          "select_kernels": "dispatch", "Linear": "linear", "rms_norm": "reference.norm",
          "RotaryEmbedding": "reference.rotary", "apply_rotary": "reference.rotary", "mrope_rows": "reference.rotary"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
