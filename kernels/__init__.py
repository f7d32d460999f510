"""Model ops over one paged interface. Attention, KV store, norms, rotary and SiLU each have a torch
reference (the test oracle and the fallback), a compiled CPU kernel (kernels/csrc/, built at first use)
and a Triton kernel (triton_ops.py); weight matmuls are linear.py's. `dispatch.select_kernels` chooses."""
from .attention import AttentionMetadata, paged_attention_torch, store_kv
from .dispatch import CHOICES, KernelError, select_kernels
from .linear import Linear
from .norm import rms_norm
from .rotary import RotaryEmbedding, apply_rotary

__all__ = ["AttentionMetadata", "paged_attention_torch", "store_kv", "CHOICES", "KernelError", "select_kernels",
           "Linear", "rms_norm", "RotaryEmbedding", "apply_rotary"]
