"""Model ops over one paged interface (interface.py). Attention, KV store, norms, rotary and SiLU each have a
torch reference (reference/: the test oracle and the fallback), a compiled CPU kernel (native/csrc/, built at
first use) and a Triton kernel (triton/); weight matmuls are linear.py's. `dispatch.select_kernels` chooses.
The names below load on first use, so that naming a mode (modes.py) imports no torch."""
from __future__ import annotations

import importlib

# The kernels' surface: what the rest of the package may import of them, declared here once and enforced by
# tests/test_layering.py. Names load from their homes on first use; `reference/`, `native/`, `triton/`,
# `dispatch.py` and `interface.py` are reached only through these names. The test suite, the oracle's user,
# imports the references directly.
_HOMES = {"AttentionMetadata": "interface", "KernelSet": "interface", "paged_attention_torch": "reference.attention",
          "store_kv": "reference.attention", "CHOICES": "dispatch", "KernelError": "dispatch",
          "select_kernels": "dispatch", "Linear": "linear", "rms_norm": "reference.norm",
          "RotaryEmbedding": "reference.rotary", "apply_rotary": "reference.rotary", "mrope_rows": "reference.rotary",
          "argmax_rows": "reference.elementwise", "LoraWeights": "reference.lora",
          "bytes_per_token_head": "reference.kv_quant", "quantized_kv_caches": "reference.kv_quant",
          "quantize_weight_int8": "reference.scaled_mm", "quantize_rows_int8": "reference.scaled_mm",
          "GGUF_BLOCK": "native.quant_blocks", "GGUF_FORMATS": "native.quant_blocks",
          "native_quant_blocks": "native.quant_blocks", "cpu_identity": "native.build", "cpu_isa": "native.build",
          "TritonKernels": "triton.ops", "Int8Linear": "linear_int8", "W4A16Linear": "linear_w4a16"}
# modules the rest of the package imports whole: the modes (no torch), the weight formats and matmuls, profiling
SURFACE_MODULES = ("modes", "quantization", "linear_quant", "profiling")
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


def _give_the_name_back() -> None:
    """This folder was found as a top-level `kernels` (a Python started in the checkout's root has the root first on
    sys.path): the name is Hugging Face's `kernels` package's, which transformers imports. Load that package from the
    rest of sys.path in this module's place (an import returns what sys.modules holds once the module has run). Where
    it is not installed this module stays: it has no version, so transformers (< 5.25, which only looks for the
    package) takes it for no `kernels` at all."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != root])
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("kernels", None)
        raise


if __name__ == "kernels":
    _give_the_name_back()
